"""An embeddings request made ready for the engine: each input's token ids, rendered as
vLLM's pooling server renders them, and checked against the model as vLLM checks them."""

from __future__ import annotations

from typing import Any

from protocol.embeddings import EmbeddingRequest, check_lengths
from protocol.errors import ProtocolError
from protocol.requests import check_prompt_ids


def token_ids(tokenizer: Any, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids: a text encoded as vLLM's pooling server encodes it (with the
    tokenizer's special tokens unless the request says not), ids as given."""
    return [list(one) if isinstance(one, tuple) else
            list(tokenizer.encode(one, add_special_tokens=req.add_special_tokens)) for one in req.inputs]


def inputs(engine: Any, req: EmbeddingRequest) -> list[list[int]] | ProtocolError:
    """Each input's token ids, or why the engine cannot embed them."""
    ids = token_ids(engine.tokenizer, req)
    for one in ids:
        if (bad := check_prompt_ids(one, engine.max_token_id)) is not None:
            return ProtocolError(bad.status_code, bad.code, bad.message, "input")
    return check_lengths([len(one) for one in ids], engine.spec.max_model_len) or ids
