"""Two (or more) builds of the daemon in one run: runs and answers against the bare handler.

    python bench/compare.py [--runs N] [--answers N] [--rounds R] LABEL=DIR[,NAME=VALUE...] ...

Each LABEL=DIR starts `interactiond serve` from the checkout DIR (its interactiond.py), with the
environment variables given after it (INTERACTIOND_LOOP=asyncio, say). The daemons and the bare
handler take turns, round by round: N runs of the bench's inbox function on each daemon (16
clients), each after a round of the bare handler; then N answers of those runs the same way. For
each daemon it prints the best runs/s and answers/s, their ratios to the bare handler's best round,
and the daemon's CPU per run and per answer (median and least of its rounds). On a shared machine
this is the way to tell what one change does: both builds see the same load, in turns.

    git worktree add /tmp/before HEAD~1      # or any copy of the module with its schema files
    python bench/compare.py before=/tmp/before after=.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402


async def compare(specs: list[str], n_runs: int, n_answers: int, rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="interactiond-compare-"))
    bare_proc = bench.Proc([sys.executable, "-c", bench.BARE_SERVER])
    bare = bench.Api(bare_proc.wait_url(), "none")
    daemons: list[dict[str, Any]] = []
    try:
        for spec in specs:
            label, _, rest = spec.partition("=")
            where, *pairs = rest.split(",")
            env = {"PYTHONPATH": str(Path(where).resolve()), "INTERACTION_OPEN_REQUESTS": str(10 * rounds * n_runs)}
            env.update(dict(p.split("=", 1) for p in pairs))
            bench.ROOT = Path(where).resolve()           # `python -m interactiond` from that checkout
            db = work / f"{label}.db"
            proc = bench.start_daemon(db, env=env, log=work / f"{label}.log")
            api = bench.Api(proc.url, Path(str(db) + ".token").read_text().strip())
            status, _ = await api.call("POST", "/definitions", {"type": "interaction", "name": "approve",
                                                                "source": bench.APPROVE})
            assert status in (200, 201), status
            daemons.append({"label": label, "proc": proc, "api": api, "ids": [], "runs": [], "answers": [],
                            "cpu_run": [], "cpu_answer": []})
        for d in daemons:                                 # warm-up
            await bench.pool(200, lambda i, api=d["api"]: api.run("approve", bench.brief(i)))
        limits = []
        for _ in range(rounds):
            for d in daemons:
                limits.append(await bench.bare_rate(bare, 3000, bare_proc))

                async def seed(i: int, d: dict[str, Any] = d) -> None:
                    d["ids"].append((await d["api"].run("approve", bench.brief(i)))["run_id"])
                c0 = d["proc"].cpu_ticks()
                seconds = await bench.pool(n_runs, seed)
                d["runs"].append(n_runs / seconds)
                d["cpu_run"].append((d["proc"].cpu_ticks() - c0) / bench.CLK_TCK / n_runs * 1000)
        for r in range(rounds):
            for d in daemons:
                limits.append(await bench.bare_rate(bare, 3000, bare_proc))
                base = r * n_answers
                c0 = d["proc"].cpu_ticks()
                seconds = await bench.pool(n_answers, lambda i, d=d, base=base: d["api"].answer(
                    d["ids"][base + i], {"verdict": "approve", "note": "Ship it."}))
                d["answers"].append(n_answers / seconds)
                d["cpu_answer"].append((d["proc"].cpu_ticks() - c0) / bench.CLK_TCK / n_answers * 1000)
        limit = max(limits)
        print(f"load {os.getloadavg()[0]:.2f}; bare handler best {limit:.0f}/s of rounds {[round(x) for x in limits]},"
              f" {min(bench.BARE_CPU):.3f} ms CPU a request")
        for d in daemons:
            print(f"{d['label']:>12}: runs {max(d['runs']):6.0f}/s ratio {max(d['runs']) / limit:.3f}"
                  f" cpu {statistics.median(d['cpu_run']):.3f}/{min(d['cpu_run']):.3f} ms"
                  f" | answers {max(d['answers']):6.0f}/s ratio {max(d['answers']) / limit:.3f}"
                  f" cpu {statistics.median(d['cpu_answer']):.3f}/{min(d['cpu_answer']):.3f} ms")
    finally:
        for d in daemons:
            await d["api"].close()
            d["proc"].kill(signal.SIGTERM)
        await bare.close()
        bare_proc.kill(signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("daemon", nargs="+", help="LABEL=DIR[,NAME=VALUE...]: a checkout and its environment")
    parser.add_argument("--runs", type=int, default=2000, help="runs a round (default 2000)")
    parser.add_argument("--answers", type=int, default=2000, help="answers a round (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    args = parser.parse_args()
    if args.answers > args.runs:
        parser.error("--answers is at most --runs: each answer closes one of the runs")
    asyncio.run(compare(args.daemon, args.runs, args.answers, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
