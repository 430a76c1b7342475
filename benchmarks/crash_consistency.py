"""Crash consistency of the shared_storage store, at scale: many SIGKILLed writers.

    python benchmarks/crash_consistency.py [--trials 500] [--json PATH]

The test suite runs 50 trials; this runs more. Each trial forks a writer child that
writes framed blocks through the store's real write path, SIGKILLs it after a random
5-50 ms, and then reads every key: each must be a valid value or a miss, never wrong
data. It uses the same writer and checker as ``tests/connectors/test_shared_storage_crash.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import RESULTS, save

TESTS = Path(__file__).resolve().parent.parent / "tests" / "connectors"
sys.path.insert(0, str(TESTS))

from test_shared_storage_crash import ask, check_every_key, temps, writer  # noqa: E402

from connectors.shared_storage.store import DiskStore  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=RESULTS / "crash_consistency.json")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    wrong = 0
    valid = missing = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        store = DiskStore(root)
        with writer(root) as proc:
            for trial in range(args.trials):
                pid = int(ask(proc, f"fork {trial}"))
                time.sleep(rng.uniform(0.005, 0.05))
                os.kill(pid, signal.SIGKILL)
                ask(proc, f"reap {pid}")
                try:
                    valid, missing = check_every_key(store)
                except AssertionError:
                    wrong += 1
        left = len(temps(root))
        cleaned = store.clean_stale_temps(max_age_s=3600)
        after = check_every_key(store)
    result = {
        "trials": args.trials,
        "trials_with_wrong_data": wrong,
        "valid_keys_at_end": after[0],
        "missing_keys_at_end": after[1],
        "last_check_valid_missing": [valid, missing],
        "temp_files_left_by_killed_writers": left,
        "temp_files_cleaned": cleaned,
        "seconds": time.perf_counter() - start,
    }
    print(f"{'trials':<34}{args.trials:>8}")
    print(f"{'trials that found wrong data':<34}{wrong:>8}")
    print(f"{'keys valid / missing at the end':<34}{after[0]:>4} / {after[1]}")
    print(f"{'temp files left, then cleaned':<34}{left:>4} / {cleaned}")
    print(f"{'seconds':<34}{result['seconds']:>8.1f}")
    save(args.json, result)
    return result


if __name__ == "__main__":
    main()
