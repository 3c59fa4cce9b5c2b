"""The output loop of a steady-state decode tick: every sampled row's text and event in one call.

A decode-only tick (cext.tick ``decode_commit``) leaves a finish verdict per row: FINISH_NONE,
FINISH_STOP_ID, FINISH_LENGTH, or FINISH_UNKNOWN (more stop ids than the tick's table holds).
``emit_rows`` walks the rows once: the request's text pipeline (``req.text``: ``add``, or
``finish`` at a stop id, which outputs nothing of its own), then for a row that keeps running
one event on its group's queue; a row that ends (a stop id, a stop string, the length) or that
the loop cannot decide goes back to the caller's ``end_row`` at its place in the row order, so
the events of a group's choices keep the order of a per-row loop. An exception of one row goes
to ``fail_row`` and the other rows carry on.

The objects are the engine's (engine.core.request.Request, engine.text.TextStream,
engine.outputs.StreamEvent), read by attribute: this module imports nothing of the engine.
"""
from libc.stdint cimport int8_t

from cext.tick import FinishCode

cdef int STOP_ID = FinishCode.FINISH_STOP_ID
cdef int LENGTH = FinishCode.FINISH_LENGTH
cdef int UNKNOWN = FinishCode.FINISH_UNKNOWN


def emit_rows(list reqs, list token_ids, const int8_t[::1] codes, object event_type, object end_row,
              object fail_row):
    """For row i (request ``reqs[i]``, new id ``token_ids[i]``, verdict ``codes[i]``) of a decode tick.

    A running row puts ``event_type(group.request_id, text, [id], None, None, req.index)`` on
    ``req.group.outputs``; a row that ends calls ``end_row(i, text, finish_reason)`` ("stop" or
    "length"; the caller finishes it and puts its last event), one left to the caller calls
    ``end_row(i, None, None)``, a failed one ``fail_row(i, exc)``. Rows of finished requests are
    skipped. Returns the number of events put here.
    """
    cdef Py_ssize_t i, n = len(reqs), num_put = 0
    cdef int code
    cdef bint is_stopped
    if len(token_ids) != n or codes.shape[0] < n:
        raise ValueError(f"{n} rows need {n} token ids and verdicts, got {len(token_ids)} and {codes.shape[0]}")
    for i in range(n):
        req = reqs[i]
        if req.is_finished:  # its group failed on an earlier row of this tick
            continue
        code = codes[i]
        try:
            if code == UNKNOWN:
                end_row(i, None, None)
                continue
            stream = req.text
            if code == STOP_ID:
                text, _ = stream.finish()  # the stop token's own text is not output
                end_row(i, text, "stop")
                continue
            token_id = token_ids[i]
            text, is_stopped = stream.add(token_id)
            if is_stopped:
                end_row(i, text, "stop")
            elif code == LENGTH:
                tail, is_stopped = stream.finish()
                end_row(i, text + tail, "stop" if is_stopped else "length")
            else:
                group = req.group
                group.outputs.put(event_type(group.request_id, text, [token_id], None, None, req.index))
                num_put += 1
        except Exception as exc:
            fail_row(i, exc)
    return num_put
