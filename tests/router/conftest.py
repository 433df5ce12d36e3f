"""Fixtures of the in-process ingress tests: the tiny model, fake store and replicas
(tests/fakes.py), and a TestClient on an Ingress built with them. A test module
may override any of them (test_ingress_output.py: a SentencePiece model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from tests.conftest import tiny_assets
from tests.fakes import FakeReplicas, FakeStore, registered
from tests.router.client import ingress_client


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(tiny_assets("llama").model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore({"ad-1": registered("ad-1", 3, "/adapters/ad-1")})


@pytest.fixture
def replicas() -> FakeReplicas:
    return FakeReplicas()


@pytest.fixture
def client(model_dir, store, replicas) -> Iterator[TestClient]:
    with ingress_client(model_dir, store, replicas) as (c, _):
        yield c
