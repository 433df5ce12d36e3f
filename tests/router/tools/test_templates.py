"""An adapter's own chat template: read from its directory only (no symlink out of it),
chosen once per version (a bounded cache), parsers from its text or the config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.store.paths import AdapterRoots
from router.errors import BadRequestError
from router.options import ChatParsers, IngressOptions
from router.tools.template import ChatTemplate, Templates, adapter_template_text

BASE = ChatTemplate.chosen("{{ messages }}", "tokenizer")
HERMES = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"


def adapter(root: Path, name: str, template: str | None = None) -> str:
    path = root / name
    path.mkdir()
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return str(path)


def test_the_jinja_file_wins_then_tokenizer_config(tmp_path):
    own = adapter(tmp_path, "a", HERMES)
    assert adapter_template_text(own) == (HERMES, str(Path(own) / "chat_template.jinja"))
    other = adapter(tmp_path, "b")
    (Path(other) / "tokenizer_config.json").write_text('{"chat_template": "T"}')
    assert adapter_template_text(other) == ("T", str(Path(other) / "tokenizer_config.json"))
    assert adapter_template_text(adapter(tmp_path, "c")) is None


def test_a_template_symlinked_out_of_the_adapter_is_not_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a template")
    (tmp_path / "roots").mkdir()
    path = Path(adapter(tmp_path / "roots", "a"))
    (path / "chat_template.jinja").symlink_to(secret)
    assert adapter_template_text(str(path)) is None
    # nor registered: the store's path check covers the files the ingress reads
    with pytest.raises(BadRequestError, match="outside the configured adapter roots"):
        AdapterRoots([str(tmp_path / "roots")]).check(str(path))


def test_each_version_is_chosen_once_and_the_cache_is_bounded(tmp_path):
    templates = Templates(BASE, cache_size=2)
    path = adapter(tmp_path, "a", HERMES)
    first = templates.of("a", 1, path)
    assert first.tool_parser == "hermes" and first.text == HERMES
    (Path(path) / "chat_template.jinja").write_text("changed")
    assert templates.of("a", 1, path) is first  # the version's, as first read
    assert templates.of("a", 2, path).text == "changed"  # a new version reads again
    templates.of("b", 1, adapter(tmp_path, "b"))
    templates.of("c", 1, adapter(tmp_path, "c"))  # evicts ("a", 1)
    assert templates.of("a", 1, path).text == "changed"
    assert templates.of("b", 1, str(tmp_path / "b")) is BASE  # none of its own: the base's


@pytest.mark.parametrize("field", ["tool_parser", "reasoning_parser"])
def test_a_parser_name_nobody_registered_is_refused_in_every_place_it_is_set(field):
    for model in (IngressOptions, ChatParsers):
        with pytest.raises(ValidationError, match=f"unknown {field.replace('_', ' ')}"):
            model(**{field: "no-such-parser"})
        assert getattr(model(**{field: "none"}), field) == "none"
    with pytest.raises(ValidationError, match="unknown tool parser"):
        IngressOptions(adapter_parsers={"acme-*": {"tool_parser": "no-such-parser"}})
