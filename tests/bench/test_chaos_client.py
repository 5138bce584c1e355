"""The chaos client's view of a chat stream, on SSE bodies written here by hand (OpenAI's
streaming shape; Ballast's mid-stream failure is an error event, then `[DONE]`): only a
stream that ends with a finish_reason and `[DONE]`, and no error, is a good chat; any
other is interrupted when a fault was in effect during it, failed when none was."""

from __future__ import annotations

import json

from bench.chaos import Call, Injection, Plan, Report, judge_stream, read_stream
from journal.invariants import CHECKS, Finding


def sse(*events: dict | str) -> list[str]:
    """The lines of an SSE body, as httpx's iter_lines gives them (blank separators included)."""
    out = []
    for e in events:
        out += [f"data: {e if isinstance(e, str) else json.dumps(e)}", ""]
    return out


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict:
    delta = dict(role="assistant", content=content or "") if role else ({"content": content} if content else {})
    return dict(id="chatcmpl-abc", object="chat.completion.chunk", created=1, model="m",
                choices=[dict(index=0, delta=delta, finish_reason=finish, logprobs=None)])


ERROR = {"error": dict(message="the engine went away", type="server_error", param=None, code="engine_unavailable")}
COMPLETE = sse(chunk(role=True), chunk("hel"), chunk("lo"), chunk(finish="length"), "[DONE]")
ERROR_THEN_DONE = sse(chunk(role=True), chunk("hel"), ERROR, "[DONE]")


def test_a_complete_stream_is_ok():
    s = read_stream(COMPLETE)
    assert (s.ending, s.request_id, s.finish_reason, s.events) == ("complete", "chatcmpl-abc", "length", 4)
    assert judge_stream(s.ending, (10, 11), [(10.5, 20)]) == "ok"


def test_an_error_event_then_done_is_not_ok():
    s = read_stream(ERROR_THEN_DONE)
    assert s.done and s.ending == "error event" and s.error and s.error["code"] == "engine_unavailable"
    assert s.request_id == "chatcmpl-abc"  # the chat is still looked up in the journal
    assert judge_stream(s.ending, (10, 11), []) == "failed"
    # Even with a finish_reason before it: the error says the answer is not whole.
    s = read_stream(sse(chunk(role=True), chunk("x", finish="stop"), ERROR, "[DONE]"))
    assert s.ending == "error event"


def test_an_error_as_the_first_event():
    s = read_stream(sse(ERROR, "[DONE]"))
    assert (s.ending, s.request_id) == ("error event", None)


def test_streams_that_stop_short_are_not_ok():
    no_done = read_stream(COMPLETE[:-2])
    no_finish = read_stream(sse(chunk(role=True), chunk("hel"), "[DONE]"))
    empty = read_stream([])
    assert {no_done.ending, no_finish.ending, empty.ending} == {"cut"}
    dropped = read_stream(COMPLETE[:4])
    dropped.dropped = True  # what the client marks when the connection fails under it
    assert dropped.ending == "dropped"


def test_interrupted_only_when_a_fault_was_in_effect_during_the_stream():
    faults = [(100.0, 130.0), (200.0, float("inf"))]  # the second one never recovered
    assert judge_stream("error event", (90, 99.9), faults) == "failed"  # ended before the fault
    assert judge_stream("error event", (90, 100.0), faults) == "interrupted"
    assert judge_stream("dropped", (110, 112), faults) == "interrupted"
    assert judge_stream("cut", (129, 140), faults) == "interrupted"
    assert judge_stream("error event", (130.1, 150), faults) == "failed"  # after recovery, before the next
    assert judge_stream("error event", (300, 301), faults) == "interrupted"


def test_the_report_counts_error_ended_chats_apart_from_good_ones_and_fails_on_failed():
    inj = Injection("engine", at=100.0, how="SIGKILL", recovered_s=30.0, until=130.0)
    r = Report(Plan(engine=1, postgres=0, temporal=0, api=0, store=0), injections=[inj])
    r.calls = [Call("engine", "chat", "ok", 200, "a", (1, 2), "complete"),
               Call("engine", "chat", "cut", 200, "b", (99, 101), "error event", "engine_unavailable"),
               Call("engine", "chat", "cut", 200, "c", (140, 141), "error event", "engine_unavailable"),
               Call("engine", "chat", "cut", None, None, (105, 105.1), "dropped")]
    assert any("cut" in f for f in r.failures())  # not yet judged: not a pass
    r.judge_chats()
    s = r.summary()
    assert s["chats"] == dict(ok=1, interrupted=2, failed=1)
    assert s["chat_endings"] == {"failed: error event (engine_unavailable)": 1,
                                 "interrupted: dropped": 1, "interrupted: error event (engine_unavailable)": 1}
    assert r.failures() == ["invariants: no rows examined at all", "1 × chat failed during engine"]
    r.findings = [Finding(CHECKS[0], violations=0, examined=12)]  # the audit saw rows and found nothing wrong
    assert r.failures() == ["1 × chat failed during engine"]


def _chaos(tmp_path, uploads: dict[str, list[str]], made: dict[str, str]):
    from bench.chaos import Chaos

    c = Chaos(None, tmp_path, "m", Plan(), None, log=lambda *_: None)  # type: ignore[arg-type]
    c.uploads = {fid: [dict(custom_id=cid, body=dict(temperature=0)) for cid in ids] for fid, ids in uploads.items()}
    c.made = made
    return c


def _api(files: dict[str, list[str]]):
    """An API that serves each file as lines of those custom_ids (a 200 answer "t-<id>")."""
    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        fid = request.url.path.split("/")[3]
        body = "".join(json.dumps(dict(custom_id=cid, response=dict(status_code=200, body=dict(
            choices=[dict(message=dict(content=f"t-{cid}"))])))) + "\n" for cid in files[fid])
        return httpx.Response(200, text=body)

    return httpx.Client(transport=httpx.MockTransport(answer), base_url="http://api")


def _batch(bid: str, fid: str, out: str | None, total: int, completed: int, status: str = "completed") -> dict:
    return dict(id=bid, input_file_id=fid, status=status, output_file_id=out, error_file_id=None,
                request_counts=dict(total=total, completed=completed, failed=0))


def test_every_item_the_client_sent_once_by_its_own_record(tmp_path):
    c = _chaos(tmp_path, {"f1": ["a", "b"], "f2": ["c"], "f3": ["d"]}, made={"b1": "f1", "b9": "f9"})
    files = {"o1": ["a", "b"], "o2": ["c"]}
    batches = {"b1": _batch("b1", "f1", "o1", 2, 2), "b2": _batch("b2", "f2", "o2", 1, 1)}
    with _api(files) as api:
        c._check_files(api, batches)
    acc = c.report.client
    assert (acc.files_uploaded, acc.batches_answered, acc.batches_listed, acc.batches_unanswered) == (3, 2, 2, 1)
    assert (acc.items_submitted, acc.items_once, acc.items_output, acc.batches_counts_equal) == (3, 3, 3, 2)
    assert acc.batches_missing == 1 and c.report.problems == ["batch b9: the API made it, yet does not list it"]
    assert c.outputs == {("b1", "a"): "t-a", ("b1", "b"): "t-b", ("b2", "c"): "t-c"}


def test_lost_doubled_foreign_and_miscounted_items_are_found(tmp_path):
    c = _chaos(tmp_path, {"f1": ["a", "b", "c"], "f2": ["d"]}, made={"b1": "f1", "b2": "f2"})
    files = {"o1": ["a", "a", "x"]}  # b lost, c lost, a twice, x never sent
    batches = {"b1": _batch("b1", "f1", "o1", 3, 2), "b2": _batch("b2", "f2", None, 1, 0, status="failed"),
               "b3": _batch("b3", "f7", None, 1, 0)}
    with _api(files) as api:
        c._check_files(api, batches)
    acc = c.report.client  # the output file's 3 lines said "completed 2": miscounted
    assert (acc.items_submitted, acc.items_once, acc.items_lost) == (4, 0, 3)
    assert (acc.items_duplicated, acc.items_extra) == (1, 1)
    assert (acc.batches_foreign, acc.batches_completed, acc.batches_counts_equal) == (1, 1, 0)
    assert len(c.report.problems) == 4, c.report.problems  # foreign, b1's ids, b1's counts, b2 failed
