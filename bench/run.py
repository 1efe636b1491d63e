"""interactiond benchmarks: one JSON line per figure, each with its bar and whether it is met.

    python bench/run.py [--quick] [--only NAME[,NAME...]] [--keep DIR] [--check] [--record] [--profile DIR]

Everything crosses real HTTP from this process (an aiohttp client) to the daemon started as a
subprocess (`interactiond serve`) on a temporary database, exactly as a user would run it; the
comparison server (a bare aiohttp handler) is a subprocess too and is driven by the same client
in the same run, so the ratios hold on a noisy machine. bench/README.md explains each figure.

Figures (SPEC.md section 13):
  create_answer_per_s          create+answer end to end over HTTP, 16 clients          >= 1000/s
  bare_aiohttp_per_s           the same client against a bare aiohttp handler          (the limit)
  run_definition_ratio         POST /runs of an inbox function / the limit             >= 0.4
  answer_ratio_10k_open        answers with 10,000 open, 16 clients / the limit         >= 0.5
  wake_p50_ms, wake_p99_ms     answer -> a long-polling waiter answered                p99 < 10 ms
  list_p50_ms, list_p99_ms     GET /interactions?to=..&limit=50 with 10,000 open       p50 < 5 ms
  restart_to_answer_ms         kill -9 with 10,000 open, start again: first answer     < 1000 ms
  peak_rss_mb_10k_open         VmHWM of the daemon holding 10,000 open                 < 100 MB
  idle_cpu_pct_10k_open        CPU of the idle daemon with 10,000 open                 < 1 %
  reads_per_tick_1000_in_10    chat reads per read tick, 1,000 requests, 10 channels   <= 10
  storage_bytes_per_open_request  file and WAL per open request, 10,000 open            <= 3 KB
  startup_cpu_ms               CPU of a client command (--version, inbox, runs), the worst  <= 150 ms

Scale (`--only scale`; 300,000 open, or 1,000,000 with --scale): the requests are seeded in a
process of their own through the engine (no HTTP: only the daemon's memory and answers are the
figures), then the daemon starts on the database:
  scale_peak_rss_mb_delta      VmHWM with N open minus VmHWM with 10,000 open           <= 20 MB
  scale_restart_to_answer_ms   start with N open: the first answer's 200                < 1000 ms
  scale_list_p50_ms            GET /interactions?to=..&limit=50 with N open             p50 < 5 ms
  scale_storage_bytes_per_request  the file over the open requests                      <= 3 KB

Each throughput carries the daemon's CPU per operation (from /proc, all threads), the bare
handler its CPU per request. --check compares with the run recorded in bench/last.json (--record
writes it) and exits 1 when a figure is more than 15% worse.

PostgreSQL (SPEC.md section 17; `--only postgres`; skipped, with a line saying why, when no server
answers at $INTERACTIOND_BENCH_PG_DSN, else $INTERACTIOND_TEST_PG_DSN, else the local socket):
  pg_create_answer_per_s       create+answer, one daemon on a fresh database, 16 clients  >= 35% of SQLite's
                                                                                        and >= 1,000/s
  pg_cpu_ms_per_pair           daemon CPU per pair on PostgreSQL (and the server's)     <= 2.0x SQLite's
  pg_answer_ratio              answers with the open requests seeded / the limit        (reported)
  pg_two_daemons_per_s         create+answer, two daemons, clients spread over both      (reported)
  pg_wake_p50_ms, pg_wake_p99_ms  a long poll on one daemon, the answer given on another  p99 < 50 ms
  pg_capacity_N_daemons_per_s  predicted pairs/s of N = 1, 2, 4, 8 daemons, the server    (reported)
                               on a host of its own (see capacity below)
(SQLite's create+answer is measured again beside PostgreSQL's, round for round, for the ratios.)

The capacity model: each daemon is one process whose event loop holds the GIL, so it serves at
most 1 / (its CPU per pair) pairs a second on a core of its own; the server serves at most
SERVER_CORES / (its CPU per pair), SERVER_CORES being $INTERACTIOND_BENCH_PG_SERVER_CORES (else
this machine's cores); and the database's write lock, held by one group commit at a time, admits
at most 1 / (the time it is held per pair). The prediction for N daemons is the least of N times
the first, the second and the third. Two daemons against one is measured as well, but on a
2-core machine the daemons, the server and the clients share the cores, so it is not a bar.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import chat_server  # noqa: E402

CONCURRENCY = 16
PB = "/v1/orgs/local/playbooks/default"
CLK_TCK = os.sysconf("SC_CLK_TCK")

APPROVE = """---
description: Asks an owner to approve a brief (bench)
to: '{{ input.owner }}'
expires: P2D
input:
  schema:
    type: object
    required: [owner, brief]
    properties:
      owner: { type: string }
      brief: { type: string, maxLength: 4000 }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string, maxLength: 2000 }
---
Please review this brief:

{{ input.brief }}

Approve it, or ask for a revision.
"""

# Replies are read per channel: 1,000 requests in 10 channels share 10 readings.
CHANNEL_ASK = """---
description: Asks in a channel; replies are read from the whole channel (bench)
to: '{{ input.owner }}'
expires: P1D
deliver:
  server: chat
  tool: post_message
  with: { channel: '{{ input.channel }}', text: '{{ message }}' }
  sent: { conversation: /channel, id: /ts }
replies:
  conversation: '{{ sent.conversation }}'
  tool: channel_history
  with: { channel: '{{ sent.conversation }}', oldest: '{{ since | default: "0" }}' }
  read:
    list: /messages
    order: oldest_first
    each: { id: /ts, sender: /user, text: /text, to: /thread_ts }
  wait: PT5S
reply: { verdict: word, note: rest }
input:
  schema:
    type: object
    required: [owner, channel, ask]
    properties:
      owner: { type: string }
      channel: { type: string }
      ask: { type: string }
output:
  schema:
    type: object
    required: [verdict]
    properties:
      verdict: { type: string, enum: [approve, revise] }
      note: { type: string }
---
{{ input.ask }}
"""

BARE_SERVER = textwrap.dedent("""
    import json, sys
    from aiohttp import web

    async def handle(request):
        body = await request.json()
        return web.Response(text=json.dumps({"ok": True, "echo": body}), content_type="application/json")

    async def main():
        app = web.Application()
        app.router.add_post("/bare/{id}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        import asyncio
        await asyncio.Event().wait()

    import asyncio
    asyncio.run(main())
""")


# -- output -------------------------------------------------------------------------------------

FIGURES: list[dict[str, Any]] = []


def figure(name: str, value: float, unit: str, bar: str, met: bool | None, **extra: Any) -> None:
    line = {"name": name, "value": round(value, 3) if isinstance(value, float) else value, "unit": unit,
            "bar": bar, "met": met, **extra}
    FIGURES.append(line)
    print(json.dumps(line), flush=True)


def note(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


# -- processes ----------------------------------------------------------------------------------

class Proc:
    """A subprocess that prints its URL on its first line; its /proc figures."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.argv = argv
        self.log = open(log, "ab") if log else subprocess.DEVNULL
        self.started = time.perf_counter()
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=ROOT)
        self.url = ""

    def wait_url(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"{self.argv[:3]} exited with {self.p.wait()}")
            m = re.search(r"(http://[\d.]+:\d+)", line)
            if m:
                self.url = m.group(1)
                return self.url
        raise RuntimeError("no URL printed")

    @property
    def pid(self) -> int:
        return self.p.pid

    def status(self, field: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])          # kB
        raise KeyError(field)

    def cpu_ticks(self) -> int:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])     # utime + stime

    def threads(self) -> int:
        return self.status("Threads")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _daemon_env() -> dict[str, str]:
    """The environment a user's daemon runs in: bytecode is cached (an installed package ships its
    .pyc files), whatever this shell says."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def start_daemon(db: Path, *, manual: bool = False, config: Path | None = None, env: dict[str, str] | None = None,
                 log: Path | None = None) -> Proc:
    argv = [sys.executable, "-m", "interactiond", "serve", "--db", str(db), "--host", "127.0.0.1", "--port", "0"]
    if manual:
        argv += ["--clock", "manual"]
    if config:
        argv += ["--config", str(config)]
    proc = Proc(argv, env={**_daemon_env(), **(env or {})}, log=log)
    proc.wait_url()
    return proc


class Profile:
    """`--profile DIR`: py-spy samples the daemon (the thread holding the GIL, which bounds its throughput) while one part of
    the bench runs; each part's collapsed stacks go to DIR/<part>.txt, and summarize() prints where
    the time went. Sampling costs the daemon little CPU, but the figures of a profiled run are not
    the ones to record."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, part: str, pid: int) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "400", "--threads", "--gil",
                                      "--format", "raw", "--output", str(self.out / f"{part}.txt"), "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)                                  # attached before the load starts

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)
            self.proc = None


def summarize(path: Path, top: int = 25) -> str:
    """Where the samples of a py-spy raw file went: per thread, then the functions with the most
    samples on the stack (inclusive) and on top of it (self)."""
    threads: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]       # by function, not by line
        total += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        for f in set(frames[1:]):
            inclusive[f] = inclusive.get(f, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    lines = [f"{path.name}: {total} samples"]
    lines += [f"  thread {t}: {100 * c / total:.1f}%" for t, c in sorted(threads.items(), key=lambda x: -x[1])]
    lines.append("  inclusive:")
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in sorted(inclusive.items(), key=lambda x: -x[1])[:top]]
    lines.append("  self:")
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in sorted(own.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


PROFILE = Profile(None)


# -- the client ---------------------------------------------------------------------------------

class Api:
    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                                             timeout=aiohttp.ClientTimeout(total=120))

    async def close(self) -> None:
        await self.session.close()

    async def call(self, method: str, tail: str, body: Any = None) -> tuple[int, Any]:
        url = self.url + (tail if tail.startswith(("/v1/", "/healthz", "/bare/")) else PB + tail)
        async with self.session.request(method, url, json=body, headers=self.headers) as resp:
            data = await resp.read()
            return resp.status, (json.loads(data) if data else None)

    async def run(self, name: str, input_: Any) -> dict[str, Any]:
        status, run = await self.call("POST", "/runs", {"type": "interaction", "name": name, "input": input_})
        if status not in (200, 201, 202):
            raise RuntimeError(f"run: {status} {run}")
        return run

    async def answer(self, run_id: str, answer: Any) -> dict[str, Any]:
        status, fact = await self.call("POST", f"/runs/{run_id}/answer", {"answer": answer})
        if status != 200:
            raise RuntimeError(f"answer: {status} {fact}")
        return fact


async def pool(n: int, worker: Callable[[int], Awaitable[Any]], concurrency: int = CONCURRENCY) -> float:
    """Run worker(i) for i in range(n) on `concurrency` clients; returns the seconds it took."""
    counter = iter(range(n))

    async def client() -> None:
        for i in counter:
            await worker(i)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


BARE_CPU: list[float] = []      # the bare handler's CPU per request (ms), one entry per round


async def bare_rate(bare: Api, n: int, proc: "Proc | None" = None) -> float:
    """Requests per second of the same client (same code: JSON body out, JSON parsed back) against the
    bare aiohttp handler; with `proc`, its CPU per request joins BARE_CPU."""
    async def one(i: int) -> None:
        status, body = await bare.call("POST", f"/bare/{i}", {"answer": {"verdict": "approve", "note": "Ship it."}})
        assert status == 200 and body["ok"]
    await pool(min(n, 300), one)                        # warm the connections
    c0 = proc.cpu_ticks() if proc is not None else 0
    rate = n / await pool(n, one)
    if proc is not None:
        BARE_CPU.append((proc.cpu_ticks() - c0) / CLK_TCK / n * 1000)
    return rate


async def best_rate(n: int, rounds: int, worker: Callable[[int], Awaitable[Any]], offset: int = 0) -> float:
    """The best of `rounds` rates of n calls each (the machine is shared: the best round is the one
    least disturbed, for the daemon and the bare handler alike)."""
    best = 0.0
    for r in range(rounds):
        base = offset + r * n
        best = max(best, n / await pool(n, lambda i: worker(base + i)))
    return best


def brief(i: int) -> dict[str, Any]:
    return {"owner": f"user{i % 20}", "brief": f"Brief number {i}: a launch plan with a budget."}


# -- the figures --------------------------------------------------------------------------------

async def import_ms() -> float:
    """What importing the module costs on this machine now (the best of three fresh processes)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import interactiond"], check=True, cwd=ROOT, env=_daemon_env())
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def command_cpu_ms(argv: list[str], runs: int) -> float:
    """CPU (user + system) of `interactiond ARGV` in a fresh process: the best of `runs`."""
    best = float("inf")
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "interactiond", *argv], check=True, cwd=ROOT, env=_daemon_env(),
                       stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000)
    return best


async def startup_figure(args: argparse.Namespace, work: Path) -> None:
    """SPEC 13's start-up bar: a client command, run as a user runs it against a serving daemon."""
    db = work / "startup.db"
    daemon = start_daemon(db, log=work / "startup.log")
    try:
        runs = 3 if args.quick else 7
        cpu = {name: command_cpu_ms(argv, runs) for name, argv in (
            ("version_ms", ["--version"]), ("inbox_ms", ["inbox", "--db", str(db)]),
            ("runs_ms", ["runs", "--db", str(db)]))}
        worst = max(cpu.values())
        figure("startup_cpu_ms", worst, "ms", "<= 150", worst <= 150, **{k: round(v) for k, v in cpu.items()},
               note=f"user + system CPU of each command in a fresh process, the best of {runs}; the worst command")
    finally:
        daemon.kill(signal.SIGTERM)


async def main_figures(args: argparse.Namespace, work: Path) -> None:
    quick = args.quick
    rounds = 2 if quick else 3
    n_pairs = 300 if quick else 1000                    # per round
    n_open = 10_000
    n_answer = 600 if quick else 1500                   # per round
    n_bare = 1500 if quick else 4000                    # per round
    n_lat = 100 if quick else 400
    idle_s = 3.0 if quick else 6.0

    bare_proc = Proc([sys.executable, "-c", BARE_SERVER])
    bare = Api(bare_proc.wait_url(), "none")
    db = work / "bench.db"
    env = {"INTERACTION_OPEN_REQUESTS": str(n_open + rounds * n_answer + 1000)}
    daemon = start_daemon(db, env=env, log=work / "daemon.log")
    api = Api(daemon.url, (Path(str(db) + ".token")).read_text().strip())
    limits: list[float] = []
    try:
        status, _ = await api.call("POST", "/definitions", {"type": "interaction", "name": "approve", "source": APPROVE})
        assert status in (200, 201), status
        answer = {"verdict": "approve", "note": "Ship it."}

        # create + answer, end to end
        async def pair(i: int) -> None:
            run = await api.run("approve", brief(i))
            await api.answer(run["run_id"], answer)
        await pool(100, pair)                            # warm-up
        PROFILE.start("pairs", daemon.pid)
        c0, t0 = daemon.cpu_ticks(), time.perf_counter()
        rate = await best_rate(n_pairs, rounds, pair)
        PROFILE.stop()
        cpu_pair = (daemon.cpu_ticks() - c0) / CLK_TCK / (rounds * n_pairs) * 1000
        figure("create_answer_per_s", rate, "pairs/s", ">= 1000", rate >= 1000, daemon_cpu_ms_per_pair=round(cpu_pair, 3),
               note="POST /runs then POST /runs/{id}/answer, 16 clients, over HTTP; best of %d rounds" % rounds)

        # run_definition: seed the open requests through the API, 16 clients, in rounds between
        # rounds of the bare handler
        run_ids: list[str] = []

        async def seed(i: int) -> None:
            run_ids.append((await api.run("approve", brief(i)))["run_id"])
        total = n_open + rounds * n_answer
        chunk = total // 4
        runs_rate = 0.0
        PROFILE.start("runs", daemon.pid)
        c0 = daemon.cpu_ticks()
        for k in range(4):
            limits.append(await bare_rate(bare, n_bare, bare_proc))
            n = chunk if k < 3 else total - 3 * chunk
            runs_rate = max(runs_rate, n / await pool(n, lambda i, base=k * chunk: seed(base + i)))
        cpu_run = (daemon.cpu_ticks() - c0) / CLK_TCK / total * 1000
        PROFILE.stop()
        limit = max(limits)
        figure("bare_aiohttp_per_s", limit, "requests/s", "the limit (SPEC: 3,000-5,500 on this machine)", None,
               rounds=[round(x) for x in limits], cpu_ms_per_request=round(min(BARE_CPU), 3),
               note="best round, the same client against a bare aiohttp handler; its CPU per request is the"
                    " least of its rounds")
        figure("run_definition_ratio", runs_rate / limit, "ratio", ">= 0.4", runs_rate / limit >= 0.4,
               runs_per_s=round(runs_rate, 1), daemon_cpu_ms_per_run=round(cpu_run, 3),
               note=f"{total} runs of an inbox function (the seeding), 16 clients, best of 4 rounds")

        # list_interactions, 10,000 open, filtered by `to`
        lat = []
        c0 = daemon.cpu_ticks()
        for i in range(n_lat):
            t0 = time.perf_counter()
            status, page = await api.call("GET", f"/interactions?to=user{i % 20}&limit=50")
            lat.append((time.perf_counter() - t0) * 1000)
            assert status == 200 and len(page["data"]) == 50, status
        cpu_list = (daemon.cpu_ticks() - c0) / CLK_TCK / n_lat * 1000
        figure("list_p50_ms", statistics.median(lat), "ms", "< 5", statistics.median(lat) < 5, open=total,
               daemon_cpu_ms_per_page=round(cpu_list, 3))
        figure("list_p99_ms", pct(lat, 99), "ms", "(reported)", None)

        # answer -> waiting caller woken
        waiter = Api(daemon.url, api.headers["Authorization"][7:])
        wake, after_ack = [], []
        for i in range(n_lat):
            run = await api.run("approve", brief(i))
            wait = asyncio.ensure_future(waiter.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
            await asyncio.sleep(0.02)                    # the waiter is parked
            t0 = time.perf_counter()
            await api.answer(run["run_id"], answer)
            t1 = time.perf_counter()
            status, ended = await wait
            t2 = time.perf_counter()
            wake.append((t2 - t0) * 1000)
            after_ack.append(max(0.0, t2 - t1) * 1000)
            assert status == 200 and ended["status"] == "succeeded", (status, ended)
        await waiter.close()
        figure("wake_p50_ms", statistics.median(wake), "ms", "(reported)", None)
        figure("wake_p99_ms", pct(wake, 99), "ms", "< 10", pct(wake, 99) < 10,
               after_answer_ack_p50_ms=round(statistics.median(after_ack), 3),
               after_answer_ack_p99_ms=round(pct(after_ack, 99), 3),
               note="from sending the answer to the long-polling waiter's response (the answer's own call included)")

        # answer throughput with 10,000 open, in rounds between rounds of the bare handler
        to_answer = run_ids[:rounds * n_answer]

        async def answer_one(i: int) -> None:
            await api.answer(to_answer[i], answer)
        ans_rate = 0.0
        answer_limits = []
        PROFILE.start("answers", daemon.pid)
        c0 = daemon.cpu_ticks()
        for r in range(rounds):
            answer_limits.append(await bare_rate(bare, n_bare, bare_proc))
            ans_rate = max(ans_rate, n_answer / await pool(n_answer, lambda i, base=r * n_answer: answer_one(base + i)))
        cpu_answer = (daemon.cpu_ticks() - c0) / CLK_TCK / (rounds * n_answer) * 1000
        PROFILE.stop()
        limit2 = max(answer_limits + [limit])
        figure("answer_ratio_10k_open", ans_rate / limit2, "ratio", ">= 0.5", ans_rate / limit2 >= 0.5,
               answers_per_s=round(ans_rate, 1), bare_per_s=round(limit2, 1), daemon_cpu_ms_per_answer=round(cpu_answer, 3),
               note=f"{rounds} rounds of {n_answer} answers, {total} -> {n_open} open, 16 clients, best round")

        rss1 = daemon.status("VmHWM") / 1024
        threads = daemon.threads()
        await api.close()

        # restart: kill -9 with 10,000 open, start again, time until an answer succeeds
        daemon.kill(signal.SIGKILL)
        imports = await import_ms()
        t0 = time.perf_counter()
        daemon = start_daemon(db, env=env, log=work / "daemon.log")
        listening = (time.perf_counter() - t0) * 1000
        api = Api(daemon.url, api.headers["Authorization"][7:])
        await api.answer(run_ids[rounds * n_answer], answer)
        restart_ms = (time.perf_counter() - t0) * 1000
        status, page = await api.call("GET", "/interactions?limit=1")
        figure("restart_to_answer_ms", restart_ms, "ms", "< 1000", restart_ms < 1000, imports_ms=round(imports),
               listening_ms=round(listening), after_imports_ms=round(restart_ms - imports),
               note="from spawning the process to the first answer's 200; imports_ms is `python -c 'import "
                    "interactiond'` alone, measured just before")

        # idle with 10,000 open
        await asyncio.sleep(1.0)
        c0, w0 = daemon.cpu_ticks(), time.perf_counter()
        await asyncio.sleep(idle_s)
        cpu = (daemon.cpu_ticks() - c0) / CLK_TCK / (time.perf_counter() - w0) * 100
        rss2 = daemon.status("VmHWM") / 1024
        figure("peak_rss_mb_10k_open", max(rss1, rss2), "MB", "< 100", max(rss1, rss2) < 100,
               seeded_process_mb=round(rss1, 1), restarted_process_mb=round(rss2, 1), threads=threads)
        figure("idle_cpu_pct_10k_open", cpu, "%", "< 1", cpu < 1, seconds=idle_s)
        await api.close()
    finally:
        daemon.kill(signal.SIGTERM)
        bare_proc.kill(signal.SIGTERM)
        await bare.close()


#: Seeds open requests of APPROVE into a database through the engine, in group commits of 512.
SEEDER = """
import asyncio, sys
import interactiond as itd
db, start, n, source = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
async def main():
    config = itd.Config(playbooks={"local/default": ()}, open_requests=10_000_000)
    eng = itd.Engine(itd.Store(db), itd.SystemClock(), config)
    await eng.store.open()
    await eng.start()
    op, pb = itd.OPERATOR_LOCAL, "local/default"
    if start == 0:
        await eng.create_definition(op, pb, "interaction", "approve", source)
    for base in range(start, start + n, 512):
        await asyncio.gather(*(eng.run_definition(op, pb, "interaction", "approve",
                                                  {"owner": f"user{i % 20}", "brief": f"Brief number {i}."})
                               for i in range(base, min(base + 512, start + n))))
    await eng.stop()
    await eng.store.close()
asyncio.run(main())
"""


async def scale_figures(args: argparse.Namespace, work: Path) -> None:
    """Memory, restart and listing with many open requests, against the same daemon with 10,000."""
    n = 1_000_000 if args.scale else 300_000
    db = work / "scale.db"
    env = {"INTERACTION_OPEN_REQUESTS": str(n + 10_000)}

    def seed(start: int, count: int) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", SEEDER, str(db), str(start), str(count), APPROVE], check=True,
                       cwd=ROOT, env=_daemon_env())
        return count / (time.perf_counter() - t0)

    async def measure(open_: int) -> dict[str, float]:
        t0 = time.perf_counter()
        daemon = start_daemon(db, env=env, log=work / "scale.log")
        api = Api(daemon.url, (Path(str(db) + ".token")).read_text().strip())
        try:
            status, page = await api.call("GET", "/interactions?to=user7&limit=1")
            assert status == 200 and page["data"], status
            await api.answer(page["data"][0]["run_id"], {"verdict": "approve"})
            restart = (time.perf_counter() - t0) * 1000
            lat = []
            for i in range(200):
                t1 = time.perf_counter()
                status, page = await api.call("GET", f"/interactions?to=user{i % 20}&limit=50")
                lat.append((time.perf_counter() - t1) * 1000)
                assert status == 200 and len(page["data"]) == 50, status
            await asyncio.sleep(1.0)
            return {"rss": daemon.status("VmHWM") / 1024, "restart": restart, "list": statistics.median(lat)}
        finally:
            await api.close()
            daemon.kill(signal.SIGTERM)

    rate = seed(0, 10_000)
    small = await measure(10_000)
    rate = min(rate, seed(10_000, n - 10_000))
    large = await measure(n)
    delta = large["rss"] - small["rss"]
    figure("scale_peak_rss_mb_delta", delta, "MB", "<= 20", delta <= 20, open=n, rss_10k_mb=round(small["rss"], 1),
           rss_mb=round(large["rss"], 1), seeded_per_s=round(rate),
           note="VmHWM after a start, a listing page, an answer and 200 pages, with N open and with 10,000")
    figure("scale_restart_to_answer_ms", large["restart"], "ms", "< 1000", large["restart"] < 1000, open=n,
           with_10k_ms=round(small["restart"]))
    figure("scale_list_p50_ms", large["list"], "ms", "< 5", large["list"] < 5, open=n)
    per = (db.stat().st_size + (Path(str(db) + "-wal").stat().st_size if Path(str(db) + "-wal").exists() else 0)) / n
    figure("scale_storage_bytes_per_request", per, "bytes", "<= 3072 (3 KB)", per <= 3072, open=n)


def input_of(i: int, size: int) -> dict[str, Any]:
    """An input of the bench's function that is `size` bytes as compact JSON (the brief padded)."""
    value = {"owner": f"user{i % 20}", "brief": f"Brief number {i}: a launch plan with a budget. "}
    pad = size - len(json.dumps(value, separators=(",", ":")))
    value["brief"] += ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
    return value


async def storage_figure(args: argparse.Namespace, work: Path) -> None:
    """Bytes of database file per open request: 10,000 runs of the inbox function with a 500-byte
    input, the WAL checkpointed into the file, the file's size over the requests (dbstat says where
    the bytes are)."""
    n, size = 10_000, 500
    db = work / "storage.db"
    daemon = start_daemon(db, env={"INTERACTION_OPEN_REQUESTS": str(n + 100)}, log=work / "storage.log")
    api = Api(daemon.url, (Path(str(db) + ".token")).read_text().strip())
    try:
        status, _ = await api.call("POST", "/definitions", {"type": "interaction", "name": "approve", "source": APPROVE})
        assert status in (200, 201), status
        inputs = [input_of(i, size) for i in range(n)]
        assert all(len(json.dumps(x, separators=(",", ":"))) == size for x in inputs[:5])
        await pool(n, lambda i: api.run("approve", inputs[i]))
        status, page = await api.call("GET", "/interactions?limit=1")
        assert status == 200 and page["data"], status
        import sqlite3
        wal = Path(str(db) + "-wal")
        await asyncio.sleep(2.0)                    # the daemon's own checkpoint once its writes go quiet
        left = db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
        conn = sqlite3.connect(db, timeout=10)
        try:
            for _ in range(50):                     # the daemon's own checkpointer may be copying
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy:
                    break
                await asyncio.sleep(0.1)
            assert busy == 0, "the checkpoint could not finish"
            pages = conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC").fetchall()
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
        file_bytes = db.stat().st_size
        per = left / n
        figure("storage_bytes_per_open_request", per, "bytes", "<= 3072 (3 KB)", per <= 3072,
               rows_bytes_per_request=round(file_bytes / n), open=n, input_bytes=size, schema_version=version,
               by_table={name: round(b / n) for name, b in pages if b / n >= 1},
               note="the database file and its WAL as the daemon leaves them once its writes go quiet, over the"
                    " open requests; rows_bytes_per_request: the file alone after a TRUNCATE checkpoint; by_table"
                    " from dbstat")
    finally:
        await api.close()
        daemon.kill(signal.SIGTERM)


async def reads_figure(args: argparse.Namespace, work: Path) -> None:
    """1,000 requests delivered into 10 channels: how many reads each read tick makes."""
    chat_db = work / "chat.db"
    config = work / "bench.yaml"
    config.write_text(json.dumps({
        "servers": {"chat": {"command": [sys.executable, str(ROOT / "examples" / "chat_server.py"), "serve",
                                         "--db", str(chat_db)]}},
        "playbooks": {"local/default": {"servers": ["chat"]}}}))
    db = work / "reads.db"
    daemon = start_daemon(db, manual=True, config=config, log=work / "reads.log")
    api = Api(daemon.url, (Path(str(db) + ".token")).read_text().strip())
    n, channels = 1000, 10
    try:
        status, body = await api.call("POST", "/definitions", {"type": "interaction", "name": "ask",
                                                               "source": CHANNEL_ASK})
        assert status in (200, 201), body

        async def one(i: int) -> None:
            await api.run("ask", {"owner": f"user{i % 50}", "channel": f"team{i % channels}", "ask": f"Question {i}?"})
        await pool(n, one)
        status, _ = await api.call("POST", "/v1/admin/clock", {"advance": "PT0S"})   # every first attempt
        assert status == 200
        delivered = chat_server.calls(str(chat_db), "post_message")
        ticks = []
        for step in ("PT5S", "PT10S", "PT20S"):
            before = chat_server.calls(str(chat_db), "channel_history")
            status, _ = await api.call("POST", "/v1/admin/clock", {"advance": step})
            assert status == 200
            ticks.append(chat_server.calls(str(chat_db), "channel_history") - before)
        worst = max(ticks)
        figure("reads_per_tick_1000_in_10", worst, "reads/tick", "<= 10 (not 1,000)", worst <= channels and worst > 0,
               ticks=ticks, delivered=delivered)
    finally:
        await api.close()
        daemon.kill(signal.SIGTERM)


# -- the record and the check ------------------------------------------------------------------

LAST = ROOT / "bench" / "last.json"
#: What --check compares with the recorded run: (figure, field, which way is better). Absolute
#: throughputs are left out (they follow the machine's load; the ratios and the CPU per operation
#: beside them do not, or much less), and so are p99s (one slow sample moves them).
CHECKED: tuple[tuple[str, str, str], ...] = (
    ("create_answer_per_s", "daemon_cpu_ms_per_pair", "lower"),
    ("run_definition_ratio", "value", "higher"),
    ("run_definition_ratio", "daemon_cpu_ms_per_run", "lower"),
    ("answer_ratio_10k_open", "value", "higher"),
    ("answer_ratio_10k_open", "daemon_cpu_ms_per_answer", "lower"),
    ("list_p50_ms", "value", "lower"),
    ("list_p50_ms", "daemon_cpu_ms_per_page", "lower"),
    ("wake_p50_ms", "value", "lower"),
    ("restart_to_answer_ms", "value", "lower"),
    ("peak_rss_mb_10k_open", "value", "lower"),
    ("storage_bytes_per_open_request", "value", "lower"),
    ("reads_per_tick_1000_in_10", "value", "lower"),
    ("startup_cpu_ms", "value", "lower"),
)
#: How much worse than the recorded run a checked figure may be.
TOLERANCE = 0.15


def check(figures: list[dict[str, Any]], recorded: dict[str, Any]) -> list[str]:
    """The checked figures more than TOLERANCE worse than the recorded run's, and every bar missed
    that the recorded run met; each as one line."""
    before = {f["name"]: f for f in recorded["figures"]}
    worse = []
    for f in figures:
        old = before.get(f["name"])
        if old is not None and f["met"] is False and old["met"] is True:
            worse.append(f"{f['name']}: {f['value']} misses its bar {f['bar']} (recorded: {old['value']})")
    now = {f["name"]: f for f in figures}
    for name, field, better in CHECKED:
        if name not in now or name not in before or field not in now[name] or field not in before[name]:
            continue
        new, old = float(now[name][field]), float(before[name][field])
        if old <= 0:
            continue
        change = (new - old) / old if better == "lower" else (old - new) / old
        if change > TOLERANCE:
            worse.append(f"{name}.{field}: {new:g} against {old:g} recorded, {100 * change:.0f}% worse")
    return worse


def record(figures: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """This run's figures as bench/last.json (merged into the recorded ones for a partial run)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    kept = json.loads(LAST.read_text())["figures"] if LAST.exists() and args.only else []
    names = {f["name"] for f in figures}
    LAST.write_text(json.dumps({
        "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load": round(os.getloadavg()[0], 2), "cores": os.cpu_count(), "quick": bool(args.quick),
        "figures": [f for f in kept if f["name"] not in names] + figures}, indent=1) + "\n")
    note(f"recorded in {LAST.relative_to(ROOT)}")


# -- PostgreSQL -----------------------------------------------------------------------------------

PG_DSN = os.environ.get("INTERACTIOND_BENCH_PG_DSN") or os.environ.get("INTERACTIOND_TEST_PG_DSN") \
    or "postgresql:///postgres"


class _ServedIn(Proc):
    """`interactiond serve` in a directory of its own: daemons of one PostgreSQL database each keep
    their lock, token and URL files in their working directory."""

    def __init__(self, db: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.argv = [sys.executable, "-m", "interactiond", "serve", "--db", db, "--host", "127.0.0.1", "--port", "0"]
        self.log = open(cwd / "daemon.log", "ab")
        self.started = time.perf_counter()
        self.p = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, cwd=cwd,
                                  env={**_daemon_env(), "PYTHONPATH": str(ROOT), **(env or {})})
        self.url = ""
        self.wait_url()
        token = next(cwd.glob("*.token"), None) or Path(db + ".token")
        self.token = token.read_text().strip()


def _pg_server() -> tuple[Any, str]:
    """An admin connection to the PostgreSQL server the figures use, or why there is none."""
    try:
        import psycopg
    except ImportError:
        return None, "psycopg is not installed (pip install 'interactiond[postgres]')"
    try:
        return psycopg.connect(PG_DSN, autocommit=True, connect_timeout=5), ""
    except Exception as exc:
        return None, f"no PostgreSQL server at {PG_DSN}: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"


def _pg_url(name: str) -> str:
    from urllib.parse import urlsplit
    parts = urlsplit(PG_DSN)
    return f"{parts.scheme}://{parts.netloc}/{name}" + (f"?{parts.query}" if parts.query else "")


def _postgres_ticks(database: str) -> dict[int, int]:
    """utime+stime of each PostgreSQL server process on this machine that works for `database`: its
    backends, and the server's own processes (WAL writer, checkpointer, ...); other databases'
    backends (other work on a shared machine) are left out."""
    ticks: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            title = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "(postgres)" not in text[:80]:
            continue
        backend = "[local]" in title or "(" in title.partition(": ")[2]
        if backend and f" {database} " not in title:
            continue
        fields = text[text.rindex(")") + 2:].split()
        ticks[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
    return ticks


def _postgres_cpu_since(database: str, before: dict[int, int]) -> int:
    """The ticks `database`'s server processes spent since `before` (_postgres_ticks); a process that
    ended meanwhile is not counted, none counts less than nothing."""
    return sum(max(0, t - before.get(pid, 0)) for pid, t in _postgres_ticks(database).items())


async def _paired_rounds(sides: dict[str, tuple[list[Api], list[Proc]]], n: int, rounds: int,
                         database: str) -> dict[str, dict[str, float]]:
    """Create+answer rate of each side (its clients spread over its daemons), in rounds taken in turn, so
    the machine's noise falls on every side alike: the best round's pairs/s, and the daemons' CPU per pair
    over every round."""
    answer = {"verdict": "approve", "note": "Ship it."}
    out: dict[str, dict[str, float]] = {}
    for name, (apis, procs) in sides.items():
        async def pair(i: int, apis: list[Api] = apis) -> None:
            api = apis[i % len(apis)]
            run = await api.run("approve", brief(i))
            await api.answer(run["run_id"], answer)
        out[name] = {"pair": pair, "best": 0.0, "ticks": 0, "server": 0}  # type: ignore[dict-item]
        await pool(100, pair)                            # warm-up
    for r in range(rounds):
        for name, (apis, procs) in sides.items():
            side = out[name]
            c0, s0 = sum(p.cpu_ticks() for p in procs), _postgres_ticks(database)
            t = await pool(n, lambda i, pair=side["pair"], base=(r + 1) * 10_000: pair(base + i))
            side["ticks"] += sum(p.cpu_ticks() for p in procs) - c0
            side["server"] += _postgres_cpu_since(database, s0)
            side["best"] = max(side["best"], n / t)
    return {name: {"per_s": side["best"], "cpu_ms": side["ticks"] / CLK_TCK / (rounds * n) * 1000,
                   "server_cpu_ms": side["server"] / CLK_TCK / (rounds * n) * 1000}
            for name, side in out.items()}


async def _commit_seconds(api: Api) -> float:
    """The daemon's time inside group commits so far (interactiond_commit_seconds_sum, from /metrics):
    on PostgreSQL, the time its writer held the database's write lock."""
    async with api.session.get(api.url + "/metrics", headers=api.headers) as resp:
        text = await resp.text()
    got = re.search(r"^interactiond_commit_seconds_sum (\S+)$", text, re.M)
    return float(got.group(1)) if got else 0.0


def capacity(daemon_cpu_ms: float, server_cpu_ms: float, lock_ms: float, server_cores: int) -> dict[int, float]:
    """The predicted pairs/s of 1, 2, 4 and 8 daemons, each on a core of its own, with the server on a
    host of its own with `server_cores` (see the module's docstring)."""
    server = server_cores * 1000 / server_cpu_ms if server_cpu_ms > 0 else float("inf")
    lock = 1000 / lock_ms if lock_ms > 0 else float("inf")
    return {n: min(n * 1000 / daemon_cpu_ms, server, lock) for n in (1, 2, 4, 8)}


async def postgres_figures(args: argparse.Namespace, work: Path) -> None:
    """The PostgreSQL figures: one daemon against SQLite's in the same run, two daemons, cross-daemon wake."""
    admin, why = _pg_server()
    if admin is None:
        note(f"PostgreSQL figures skipped: {why}")
        return
    rounds = 2 if args.quick else 3
    n_pairs = 300 if args.quick else 1000
    n_open = 2000 if args.quick else 10_000
    n_answer = 600 if args.quick else 1500
    n_lat = 100 if args.quick else 400
    name = "itd_bench_" + secrets.token_hex(4)
    admin.execute(f"CREATE DATABASE {name}")
    url = _pg_url(name)
    env = {"INTERACTION_OPEN_REQUESTS": str(n_open + rounds * (n_answer + 2 * n_pairs) + 5000)}
    procs: list[Proc] = []
    apis: list[Api] = []
    try:
        lite = _ServedIn(str(work / "pg-reference.db"), work / "sqlite", env)
        one = _ServedIn(url, work / "pg-a", env)
        procs += [lite, one]
        lite_api, pg_api = Api(lite.url, lite.token), Api(one.url, one.token)
        apis += [lite_api, pg_api]
        for api in (lite_api, pg_api):
            status, _ = await api.call("POST", "/definitions", {"type": "interaction", "name": "approve",
                                                                "source": APPROVE})
            assert status in (200, 201), status
        held0 = await _commit_seconds(pg_api)
        got = await _paired_rounds({"sqlite": ([lite_api], [lite]), "postgres": ([pg_api], [one])}, n_pairs, rounds,
                                   name)
        lock_ms = (await _commit_seconds(pg_api) - held0) / ((rounds + 1) * n_pairs + 100) * 1000    # and the warm-up
        sq, pg = got["sqlite"], got["postgres"]
        figure("pg_create_answer_per_s", pg["per_s"], "pairs/s", ">= 35% of SQLite's in the same run and >= 1,000",
               pg["per_s"] >= 0.35 * sq["per_s"] and pg["per_s"] >= 1000, sqlite_per_s=round(sq["per_s"], 1),
               ratio=round(pg["per_s"] / sq["per_s"], 3), cpu_ms_per_pair=round(pg["cpu_ms"], 3),
               note=f"POST /runs then POST /runs/{{id}}/answer, 16 clients, one daemon; best of {rounds} rounds,"
                    " taken in turn with SQLite's")
        figure("pg_cpu_ms_per_pair", pg["cpu_ms"], "ms", "<= 2.0x SQLite's", pg["cpu_ms"] <= 2.0 * sq["cpu_ms"],
               sqlite_cpu_ms_per_pair=round(sq["cpu_ms"], 3), ratio=round(pg["cpu_ms"] / sq["cpu_ms"], 3),
               server_cpu_ms_per_pair=round(pg["server_cpu_ms"], 3), lock_ms_per_pair=round(lock_ms, 3),
               note="the daemon's CPU (all threads); server_cpu_ms_per_pair: the server's processes for this database;"
                    " lock_ms_per_pair: the writer's time in group commits, which hold the write lock")
        cores = int(os.environ.get("INTERACTIOND_BENCH_PG_SERVER_CORES") or os.cpu_count() or 1)
        for n, per_s in capacity(pg["cpu_ms"], pg["server_cpu_ms"], lock_ms, cores).items():
            figure(f"pg_capacity_{n}_daemons_per_s", per_s, "pairs/s", "(reported)", None, server_cores=cores,
                   note="predicted: min(N / daemon CPU per pair, server cores / server CPU per pair,"
                        " 1 / write lock held per pair), each daemon on a core of its own")
        await lite_api.close()
        apis.remove(lite_api)
        lite.kill(signal.SIGTERM)
        procs.remove(lite)

        # Answers with the open requests seeded, in rounds between rounds of the bare handler.
        bare_proc = Proc([sys.executable, "-c", BARE_SERVER])
        procs.append(bare_proc)
        bare = Api(bare_proc.wait_url(), "none")
        apis.append(bare)
        run_ids: list[str] = []

        async def seed(i: int) -> None:
            run_ids.append((await pg_api.run("approve", brief(i)))["run_id"])
        t0 = time.perf_counter()
        await pool(n_open + rounds * n_answer, seed)
        seed_rate = (n_open + rounds * n_answer) / (time.perf_counter() - t0)
        answer_rates, limits = [], []
        for r in range(rounds):
            limits.append(await bare_rate(bare, 1500 if args.quick else 4000))
            batch = run_ids[r * n_answer:(r + 1) * n_answer]
            answer_rates.append(n_answer / await pool(n_answer, lambda i, b=batch: pg_api.answer(
                b[i], {"verdict": "approve"})))
        ans_rate = max(answer_rates)
        figure("pg_answer_ratio", ans_rate / max(limits), "ratio", "(reported; SQLite's bar is >= 0.5)", None,
               answers_per_s=round(ans_rate, 1), rounds=[round(x) for x in answer_rates], bare_per_s=round(max(limits), 1),
               runs_per_s=round(seed_rate, 1),
               note=f"{rounds} rounds of {n_answer} answers with {n_open}+ open, 16 clients, one daemon, best round")

        # Two daemons on the database, the clients spread over both.
        two = _ServedIn(url, work / "pg-b", env)
        procs.append(two)
        pg_api2 = Api(two.url, two.token)
        apis.append(pg_api2)
        got = await _paired_rounds({"one": ([pg_api], [one]), "two": ([pg_api, pg_api2], [one, two])}, n_pairs, rounds,
                                   name)
        figure("pg_two_daemons_per_s", got["two"]["per_s"], "pairs/s", "(reported: the daemons, the server and the"
               " clients share this machine's cores)", None, one_daemon_per_s=round(got["one"]["per_s"], 1),
               cpu_ms_per_pair=round(got["two"]["cpu_ms"], 3), one_daemon_cpu_ms_per_pair=round(got["one"]["cpu_ms"], 3),
               note=f"16 clients, each pair on one of the two daemons in turn; best of {rounds} rounds, taken in turn"
                    " with one daemon's; cpu: both daemons")

        # A long poll on one daemon, the answer given on the other.
        waiter = Api(one.url, one.token)
        apis.append(waiter)
        wake = []
        for i in range(n_lat):
            run = await pg_api.run("approve", brief(i))
            wait = asyncio.ensure_future(waiter.call("POST", f"/runs/{run['run_id']}/wait?timeout=30"))
            await asyncio.sleep(0.02)
            t0 = time.perf_counter()
            await pg_api2.answer(run["run_id"], {"verdict": "approve"})
            status, ended = await wait
            wake.append((time.perf_counter() - t0) * 1000)
            assert status == 200 and ended["status"] == "succeeded", (status, ended)
        figure("pg_wake_p50_ms", statistics.median(wake), "ms", "(reported)", None)
        figure("pg_wake_p99_ms", pct(wake, 99), "ms", "< 50", pct(wake, 99) < 50,
               note="a long poll on daemon A; from sending the answer to daemon B to the waiter's response")
    finally:
        for api in apis:
            await api.close()
        for proc in procs:
            proc.kill(signal.SIGTERM)
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


async def amain(args: argparse.Namespace) -> int:
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="interactiond-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    note(f"work directory {work}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    try:
        if not args.only or "main" in args.only:
            await main_figures(args, work)
        if not args.only or "storage" in args.only:
            await storage_figure(args, work)
        if not args.only or "reads" in args.only:
            await reads_figure(args, work)
        if not args.only or "postgres" in args.only:
            await postgres_figures(args, work)
        if not args.only or "startup" in args.only:
            await startup_figure(args, work)
        if not args.only or "scale" in args.only:
            await scale_figures(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if PROFILE.out is not None:
        for part in sorted(PROFILE.out.glob("*.txt")):
            print(summarize(part), file=sys.stderr)
    missed = [f["name"] for f in FIGURES if f["met"] is False]
    note(f"{len(FIGURES)} figures, missed: {', '.join(missed) or 'none'}")
    status = 0
    if args.check:
        if not LAST.exists():
            note(f"--check: no recorded run in {LAST.relative_to(ROOT)}; record one with --record")
            return 2
        recorded = json.loads(LAST.read_text())
        worse = check(FIGURES, recorded)
        note(f"--check against {recorded['commit']} ({recorded['date']}, load {recorded['load']}): "
             + ("no figure more than 15% worse" if not worse else f"{len(worse)} worse"))
        for line in worse:
            note("  " + line)
        status = 1 if worse else 0
    if args.record:
        record(FIGURES, args)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples: a run of about a minute")
    parser.add_argument("--only", type=lambda s: s.split(","), help="main, storage, reads, postgres, startup and/or scale")
    parser.add_argument("--scale", action="store_true", help="the scale part with 1,000,000 open requests"
                        " (300,000 without it)")
    parser.add_argument("--keep", help="work in this directory and keep it (logs, databases)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure is more than 15%% worse than"
                        " the run recorded in bench/last.json (or misses a bar it met)")
    parser.add_argument("--record", action="store_true", help="write this run's figures to bench/last.json")
    parser.add_argument("--profile", type=Path, help="sample the daemon with py-spy during the throughput parts;"
                        " the stacks go to this directory, a summary to stderr")
    args = parser.parse_args()
    PROFILE.out = args.profile
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
