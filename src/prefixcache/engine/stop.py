"""Stop rules and streamed text for one choice: EOS / stop token ids, stop strings, max_tokens.

Stop strings are searched only in the text tail a new token can have changed, cut from the
output (kept, up to their end, with ``include_stop_str_in_output``), and never streamed early: up
to ``len(longest stop) - 1`` trailing characters are held back until they are known not to start
a stop string. Below ``min_tokens`` output tokens only ``max_tokens`` ends a choice (as vLLM).
Knows nothing about caches or tensors.
"""

from __future__ import annotations

from collections.abc import Collection

from prefixcache.engine.request import Request
from prefixcache.sched.request import RequestStatus

__all__ = ["check_stop", "emittable_text"]


def check_stop(
    request: Request, token_id: int, eos_token_ids: Collection[int]
) -> RequestStatus | None:
    """Account for ``token_id`` (already appended): update the text, return a finish status."""
    params = request.params
    num_output = len(request.output_token_ids)
    may_stop = num_output >= params.min_tokens
    if may_stop and (
        (not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids
    ):
        request.text += request.detokenizer.flush()
        return RequestStatus.FINISHED_STOPPED
    delta = request.detokenizer.add(token_id)
    if delta:
        request.text += delta
        if may_stop and params.stop and _cut_at_stop(request, len(delta)):
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens:
        request.text += request.detokenizer.flush()
        if params.stop and _cut_at_stop(request, len(request.text)):
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH
    return None


def _cut_at_stop(request: Request, num_new_chars: int) -> bool:
    text = request.text
    start = max(0, len(text) - num_new_chars - request.params.max_stop_len + 1)
    found = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in request.params.stop)
             if i >= 0]
    if not found:
        return False
    at, length = min(found)
    request.text = text[: at + length if request.params.include_stop_str_in_output else at]
    return True


def emittable_text(request: Request) -> str:
    """The text not yet streamed that is safe to stream now (all of it once finished)."""
    text = request.text
    limit = len(text)
    if not request.is_finished and request.params.stop:
        limit -= request.params.max_stop_len - 1
    if limit <= request.num_text_emitted:
        return ""
    delta = text[request.num_text_emitted : limit]
    request.num_text_emitted = limit
    return delta
