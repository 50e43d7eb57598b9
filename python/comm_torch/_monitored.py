"""``monitored_barrier``: a barrier that names the ranks that failed to reach it in time.

It runs over the group's c10d store (the control plane torch gives every backend), not over the
communicator. A monitored barrier exists to diagnose ranks that hang, typically inside a
collective; a barrier built from sends and receives on the same communicator would queue behind
that collective and hang with it instead of reporting it.

The protocol and the messages follow gloo's (ProcessGroupGloo::monitoredBarrier), since users and
torch's tests match on them:

* every rank but 0 announces its arrival and waits for rank 0's verdict;
* rank 0 waits for ranks 1, 2, ... in order. By default the timeout covers the whole barrier
  and the first rank missing is reported ("Rank 1 failed to pass monitoredBarrier in 2000 ms");
  with ``wait_all_ranks`` each rank gets the full timeout and every missing rank is reported
  ("Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms"). A timeout used up before rank 0
  has looked at every rank reads "Rank 0 timed out in monitoredBarrier after 0 ms.";
* rank 0 then publishes its verdict: the ranks that did arrive pass the barrier together, or all
  fail at once with rank 0's message (gloo leaves them to their own timeout instead).
"""

import datetime
import time

from ._lib import CommError

_KEY = "comm_torch/monitored_barrier"
# A c10d store reads a zero timeout as "wait forever" (kNoTimeout); the shortest real wait is 1 ms.
_MIN_WAIT = 0.001


def _ms(seconds):
    return round(seconds * 1000)


def _wait(store, key, seconds):
    store.wait([key], datetime.timedelta(seconds=max(seconds, _MIN_WAIT)))


def monitored_barrier(store, rank, size, seq, timeout, wait_all_ranks, peer_timeout):
    """Runs monitored barrier number ``seq`` of a group of ``size`` ranks. ``timeout`` (seconds)
    bounds rank 0's wait for the others; ``peer_timeout`` bounds how long the other ranks wait
    for rank 0's verdict. Raises CommError with gloo's messages on failure."""
    key = f"{_KEY}/{seq}"
    if rank != 0:
        store.set(f"{key}/arrived/{rank}", "1")
        try:
            _wait(store, f"{key}/verdict", peer_timeout)
            verdict = store.get(f"{key}/verdict").decode(errors="replace")
        except Exception as err:  # noqa: BLE001  the store's own timeout error, or a store that went away
            verdict = f"no verdict from rank 0 within {_ms(peer_timeout)} ms: {err}"
        if verdict != "ok":
            raise CommError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n"
                f" Original exception: \n{verdict}",
                call="monitored_barrier",
            )
        return

    ms = _ms(timeout)
    start = time.monotonic()
    passed, missing = [], []
    try:
        for peer in range(1, size):
            if wait_all_ranks:
                left = timeout
            else:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    seen = (
                        f"Successfully processed ranks: {', '.join(map(str, passed))}"
                        if passed
                        else "No ranks successfully processed in monitoredBarrier."
                    )
                    raise CommError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{seen}")
            try:
                _wait(store, f"{key}/arrived/{peer}", left)
            except Exception as err:  # noqa: BLE001  as above: whatever the store raises means "missing"
                if not wait_all_ranks:
                    raise CommError(
                        f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms\n"
                        f" Original exception: \n{err}"
                    ) from None
                missing.append(peer)
            else:
                passed.append(peer)
        if missing:
            raise CommError(
                f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms"
            )
    except CommError as err:
        err.call = "monitored_barrier"
        store.set(f"{key}/verdict", str(err))
        raise
    store.set(f"{key}/verdict", "ok")
    for peer in passed:
        try:
            store.delete_key(f"{key}/arrived/{peer}")
        except Exception:  # noqa: BLE001, S110  not every store can delete; the keys are a few bytes each
            pass
