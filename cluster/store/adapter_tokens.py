"""The tokens an adapter directory adds to its base model's vocabulary.

An adapter trained after resizing the vocabulary (new special tokens for a chat or tool
format) ships them in its tokenizer files; the base's embedding and head have no rows for
their ids, so such an adapter cannot be served as trained and is refused at registration,
naming the tokens. Tokens within the base's vocabulary (a tokenizer saved beside the
adapter, its own added tokens included) are fine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tokens_beyond_vocab(adapter_dir: str | Path, vocab_size: int) -> list[str]:
    """The tokens (text) the adapter's tokenizer files give ids >= `vocab_size`: its
    added_tokens.json, tokenizer_config.json's added_tokens_decoder and tokenizer.json's
    added_tokens."""
    root = Path(adapter_dir)
    ids: dict[str, int] = {}
    added = _json(root / "added_tokens.json")
    if isinstance(added, dict):
        ids.update({str(k): v for k, v in added.items() if isinstance(v, int)})
    decoder = (_json(root / "tokenizer_config.json") or {}).get("added_tokens_decoder")
    for key, entry in (decoder or {}).items():
        if str(key).isdigit() and isinstance(entry, dict):
            ids[str(entry.get("content"))] = int(key)
    for entry in (_json(root / "tokenizer.json") or {}).get("added_tokens") or ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), int):
            ids[str(entry.get("content"))] = entry["id"]
    return sorted(token for token, i in ids.items() if i >= vocab_size)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
