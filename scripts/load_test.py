"""Load figure for `specee-cpp serve`: N concurrent OpenAI clients, local only.

Starts the server (a free local port), lets each client send streamed chat requests (dev
prompts, with ``--traffic code-edit`` edits of held-out HumanEval functions, with
``--traffic conversation`` two-turn conversations) back to back until the time is up
(requests already sent are waited for) or, with ``--requests N``, until each client has sent
its N (then two servers answer the very same prompts: in a timed run the faster one reaches
further down the list, into other prompts, and their percentiles are over other requests),
or with ``--rate R --requests N``, N requests in all, arriving at random (Poisson, R a second,
the same times for every server) whenever the others are answered or not; and reports
requests completed, refused and lost, latency and time to first token (p50/p95), and the
server's own counters, as JSON and, with ``--markdown``, as a table with the command that
made it.

    python scripts/load_test.py --clients 4 --seconds 60 [--markdown]
    python scripts/load_test.py qwen2.5-coder-1.5b --clients 4 --parallel 4 --seconds 60
    python scripts/load_test.py qwen2.5-coder-1.5b --clients 4 --traffic code-edit --peer
    python scripts/load_test.py qwen2.5-coder-1.5b --clients 2 --traffic code-edit --requests 12
    python scripts/load_test.py qwen2.5-coder-1.5b --parallel 2 --traffic code-edit \
        --rate 0.07 --requests 24 [--peer]
    python scripts/load_test.py qwen2.5-coder-1.5b --clients 4 --parallel 4 --mode spec \
        --traffic code-edit --prediction
    python scripts/load_test.py --clients 8 --seconds 60 --hostile   # second half under attack

``--hostile``: for the second half of the run, another process opens 1,000 connections that
send half a request and wait, and sends a 10 MB body once a second; the report gives the others' time to
first token and the server's /health latency in the calm half and in the hostile half
(1,000 connections need an open-file limit above that on both sides: ``ulimit -n``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def peak_rss_mib(pid: int) -> float | None:
    """The server process's peak resident memory so far (Linux; None elsewhere): what the
    run cost it, weights and KV cache included."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def start_peer(args) -> tuple[subprocess.Popen, str]:
    """llama-server (scripts/build_peers.py --server) on the same model, threads, slots
    (``-np``) and per-slot context; ready once /health answers 200."""
    import socket

    from specee_cpp.config import N_CTX, default_threads
    from specee_cpp.engine.llm import resolve

    if args.model is None:   # before a build of minutes
        sys.exit("error: --peer needs the model named")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "build_peers.py"),
                        "--server"], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit("error: llama-server could not be built (scripts/build_peers.py --server)")
    exe = Path(r.stdout.strip().splitlines()[-1]) / ("llama-server.exe" if os.name == "nt"
                                                     else "llama-server")
    with socket.socket() as sock:   # a free port (llama-server takes no port 0)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = str(default_threads())
    cmd = [str(exe), "-m", str(resolve(args.model)), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(args.parallel), "-c", str(N_CTX * args.parallel), "-t", threads,
           "-tb", threads, "--no-webui"] + (args.peer_args.split() if args.peer_args else [])
    # its log to a file: a pipe nobody reads during the run would fill and stall the server
    log = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as h:
                if h.status == 200:
                    return p, url + "/v1"
        except (urllib.error.URLError, OSError):
            pass
        if p.poll() is not None:
            log.seek(0)
            sys.exit(f"error: llama-server exited ({log.read()[-2000:]})")
        time.sleep(0.5)
    p.kill()
    sys.exit("error: llama-server did not become ready in 5 minutes")


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specee_cpp.cli", "serve", "--port", "0",
           "--max-queue", str(args.requests if args.rate else max(args.clients, 1) * 2)]
    if args.model:
        cmd.insert(4, args.model)
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.mode:
        cmd += ["--mode", args.mode]
    if args.gamma:
        cmd += ["--gamma", args.gamma]
    cmd += ["--parallel", str(args.parallel)]   # given: the server's default depends on the machine
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = p.stdout.readline()
    if "http://" not in line:
        p.kill()
        sys.exit(f"error: the server did not start ({line.strip() or 'no output'})")
    return p, line.split()[-1]


# The hostile client: 1,000 connections that send half a request and wait, and a 10 MB body
# once a second; prints what it saw as JSON.
HOSTILE = r"""
import json, socket, sys, time, urllib.error, urllib.request
url, seconds = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + seconds
host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
held = []
for _ in range(1000):
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    held.append(s)
body = b'{"messages": [{"role": "user", "content": "' + b"x" * (10 << 20) + b'"}]}'
answers = {}
while time.monotonic() < end:
    t = time.monotonic()
    req = urllib.request.Request(url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            code = str(r.status)
    except urllib.error.HTTPError as e:
        code = str(e.code)
    except OSError as e:   # an early 413 may reset the upload
        code = type(e).__name__
    answers[code] = answers.get(code, 0) + 1
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
def still_open(s):
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
print(json.dumps({"big_bodies": answers, "partial_connections": len(held),
                  "partial_still_open_at_end": sum(map(still_open, held))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="default: the registry's default pair")
    ap.add_argument("--draft")
    ap.add_argument("--mode")
    ap.add_argument("--gamma", help="the server's --gamma (with --draft and --parallel above 1: "
                                    "the draft model drafts in each slot)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1,
                    help="the server's slots (serve --parallel): requests decoded at once")
    ap.add_argument("--peer", action="store_true",
                    help="load llama-server instead (built from the pinned sources, -np "
                         "--parallel), the same model and clients")
    ap.add_argument("--peer-args", help="more llama-server flags, e.g. '--spec-type ngram-mod'")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--requests", type=int,
                    help="each client sends this many requests (conversations), however long "
                         "they take, instead of sending for --seconds")
    ap.add_argument("--rate", type=float,
                    help="open loop: --requests N in all, arriving at random at this many a "
                         "second (Poisson, the same times on every run), not from --clients "
                         "waiting for their answers; the first token's wait then does not "
                         "depend on how soon the server answered the ones before")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--traffic", choices=("chat", "code-edit", "conversation"), default="chat",
                    help="chat: Spec-Bench dev first turns (up to 1,500 characters); "
                         "code-edit: edit requests over held-out HumanEval tasks 82-163, "
                         "each with its whole function (humaneval-edit); conversation: the "
                         "dev set's two-turn MT-Bench conversations, the second turn sent "
                         "with the first and its answer (a chat window's next turn)")
    ap.add_argument("--prediction", action="store_true",
                    help="code-edit: send each request's function as its OpenAI "
                         "`prediction` (llama-server has no such field: --peer sends none)")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown table")
    ap.add_argument("--hostile", action="store_true",
                    help="second half: a 10 MB body again and again, 1,000 partial requests")
    args = ap.parse_args()
    if not 1 <= args.clients <= 32 or not 1 <= args.seconds <= 600:
        sys.exit("error: --clients must be 1..32 and --seconds 1..600 (a local, bounded test)")
    if args.requests is not None and not 1 <= args.requests <= 100:
        sys.exit(f"error: --requests must be 1..100, got {args.requests}")
    if args.rate is not None and not (args.rate > 0 and args.requests
                                      and args.traffic != "conversation" and not args.hostile):
        sys.exit(f"error: --rate {args.rate}: a positive rate with --requests (in all), not "
                 f"with --hostile or conversation traffic")
    if args.requests is not None and args.hostile:
        sys.exit("error: --hostile attacks the second half of a timed run: it takes --seconds, "
                 "not --requests")

    import openai

    from specee_cpp.bench.prompts import DEV_PROMPTS
    from specee_cpp.config import default_threads
    from specee_cpp.provenance import describe, machine
    from specee_cpp.records import records

    if args.prediction and (args.traffic != "code-edit" or args.peer):
        sys.exit("error: --prediction goes with --traffic code-edit, on our server")
    if args.traffic == "code-edit":
        from specee_cpp.bench.prompts import load_humaneval_edit
        prompts = [(p.text, p.prediction) for p in load_humaneval_edit("82-163")]
    else:   # keep prompts short: a chat turn
        prompts = [(r["turns"][0][:1500], "") for r in records(DEV_PROMPTS)]
    # each request a conversation of one turn, or of several, each turn sent with the ones
    # before it and their answers
    if args.traffic == "conversation":
        talks = [[t[:1500] for t in r["turns"]] for r in records(DEV_PROMPTS)
                 if len(r["turns"]) > 1]
    else:
        talks = [[text] for text, _ in prompts]
    server, url = start_peer(args) if args.peer else start_server(args)
    results: list[dict] = []
    lock = threading.Lock()
    try:
        deadline = time.monotonic() + args.seconds
        began = time.perf_counter()

        clients_done = threading.Event()

        def more(t0: float, sent: int) -> bool:
            """Whether a client sends another request: before the end, by the clock its
            start is read on, or until it has sent its --requests."""
            return sent < args.requests if args.requests else t0 - began < args.seconds

        def client_loop(i: int) -> None:
            c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            k, seq, half = i, 0, False
            while more(t0 := time.perf_counter(), (k - i) // args.clients):
                if hostile_on.is_set() and not half:
                    # the hostile half replays the calm half's prompts in the same order, so
                    # that each request can be set against its twin
                    k, seq, half = i, 0, True
                turns, predicted = talks[k % len(talks)], prompts[k % len(prompts)][1]
                extra = ({"prediction": {"type": "content", "content": predicted}}
                         if args.prediction else {})
                k += args.clients
                history: list[dict] = []
                for turn, text in enumerate(turns):
                    if turn:   # a conversation's later turns: all of them, or while in time
                        t0 = time.perf_counter()
                        if not args.requests and t0 - began >= args.seconds:
                            break
                    seq += 1
                    messages = history + [{"role": "user", "content": text}]
                    rec, answer = ask(c, messages, extra, t0)
                    rec.update(client=i, hostile=half, seq=seq, turn=turn)
                    with lock:
                        results.append(rec)
                    if not rec["ok"]:
                        break
                    history = messages + [{"role": "assistant", "content": answer}]

        def ask(c, messages: list[dict], extra: dict, t0: float) -> tuple[dict, str]:
            """One streamed request: its record (first token, tokens, the prompt tokens the
            server found cached where it says) and the answer's text."""
            rec = {"ok": False, "status": None, "ttft": None, "tokens": 0, "cached": None}
            pieces = []
            try:
                stream = c.chat.completions.create(
                    model="m", messages=messages, max_tokens=args.max_tokens, temperature=0,
                    stream=True, stream_options={"include_usage": True}, **extra)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                        if rec["ttft"] is None:
                            rec["ttft"] = time.perf_counter() - t0
                    if chunk.usage is not None:
                        rec["tokens"] = chunk.usage.completion_tokens
                        rec["prompt_tokens"] = chunk.usage.prompt_tokens
                        p = chunk.usage.prompt_tokens_details
                        rec["cached"] = p.cached_tokens if p is not None else None
                        d = chunk.usage.completion_tokens_details
                        if args.prediction and d is not None:
                            rec["predicted"] = (d.accepted_prediction_tokens or 0,
                                                d.rejected_prediction_tokens or 0)
                # a server that reports no usage: its streamed pieces, a token each
                rec["tokens"] = rec["tokens"] or len(pieces)
                rec["ok"] = True
            except openai.APIStatusError as e:
                rec["status"] = e.status_code
            except openai.APIError as e:
                rec["status"] = type(e).__name__
            rec["latency"] = time.perf_counter() - t0
            rec["start"] = t0 - began
            return rec, "".join(pieces)

        hostile_on = threading.Event()
        probes: list[tuple[bool, float]] = []   # (hostile, /health seconds)
        big: dict = {}

        def probe_loop() -> None:
            while not clients_done.is_set() and (args.requests or time.monotonic() < deadline):
                t0 = time.perf_counter()
                with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=60):
                    pass
                probes.append((hostile_on.is_set(), time.perf_counter() - t0))
                time.sleep(0.2)

        def hostile_loop() -> None:
            # its own process: the bench's clients keep their interpreter to themselves
            time.sleep(args.seconds / 2)
            hostile_on.set()
            rest = max(deadline - time.monotonic(), 1.0)
            r = subprocess.run([sys.executable, "-c", HOSTILE, url, str(rest)],
                               capture_output=True, text=True, timeout=rest + 120)
            big.update(json.loads(r.stdout or "{}"))

        def arrival(k: int, at: float) -> None:
            """Open loop: request ``k`` at ``at`` seconds from the start."""
            time.sleep(max(0.0, began + at - time.perf_counter()))
            c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            extra = ({"prediction": {"type": "content", "content": prompts[k % len(prompts)][1]}}
                     if args.prediction else {})
            rec, _ = ask(c, [{"role": "user", "content": talks[k % len(talks)][0]}], extra,
                         time.perf_counter())
            rec.update(client=k, hostile=False, seq=1, turn=0)
            with lock:
                results.append(rec)

        t_start = time.perf_counter()
        if args.rate:
            rng, at, times = random.Random(0), 0.0, []
            for _ in range(args.requests):
                at += rng.expovariate(args.rate)
                times.append(at)
            clients = [threading.Thread(target=arrival, args=(k, at))
                       for k, at in enumerate(times)]
        else:
            clients = [threading.Thread(target=client_loop, args=(i,))
                       for i in range(args.clients)]
        others = [threading.Thread(target=probe_loop)]
        if args.hostile:
            others.append(threading.Thread(target=hostile_loop))
        for t in clients + others:
            t.start()
        for t in clients:
            t.join()
        clients_done.set()
        for t in others:
            t.join()
        wall = time.perf_counter() - t_start
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
            health = json.loads(r.read())
        peak = peak_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)

    ok = [r for r in results if r["ok"]]
    refused = [r for r in results if r["status"] == 429]
    lost = len(results) - len(ok) - len(refused)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    later = [r["ttft"] for r in ok if r["turn"] and r["ttft"] is not None]
    said = [r for r in ok if r["turn"] and r["cached"] is not None]
    cached_share = (round(sum(r["cached"] for r in said) / sum(r["prompt_tokens"] for r in said),
                          3) if said else None)
    summary = {
        "clients": None if args.rate else args.clients, "rate": args.rate,
        "parallel": args.parallel,
        "seconds": None if args.requests else args.seconds,
        "requests_each": None if args.rate else args.requests,
        **({"requests_in_all": args.requests} if args.rate else {}),
        "max_tokens": args.max_tokens, "traffic": args.traffic,
        "prediction": args.prediction,
        "sent": len(results), "completed": len(ok), "refused_429": len(refused), "lost": lost,
        "wall_s": round(wall, 1), "requests_per_s": round(len(ok) / wall, 3),
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
        "latency_p50_s": round(percentile(lat, 0.5), 2),
        "latency_p95_s": round(percentile(lat, 0.95), 2),
        "ttft_p50_s": round(percentile(ttft, 0.5), 2),
        "ttft_p95_s": round(percentile(ttft, 0.95), 2),
        "mean_tokens": round(statistics.mean([r["tokens"] for r in ok]), 1) if ok else 0,
        # a conversation's later turns: their first token, and the share of their prompt
        # tokens the server found cached (None where it does not say)
        **({"later_turns": len(later), "later_ttft_p50_s": round(percentile(later, 0.5), 2),
            "later_ttft_p95_s": round(percentile(later, 0.95), 2),
            "later_cached_share": cached_share} if args.traffic == "conversation" else {}),
        "health_p50_s": round(percentile([t for _, t in probes], 0.5), 3),
        "health_max_s": round(max([t for _, t in probes], default=float("nan")), 3),
        "server_peak_rss_mib": peak,
        "prediction_tokens_accepted_rejected": (
            [sum(r.get("predicted", (0, 0))[j] for r in ok) for j in (0, 1)]
            if args.prediction else None),
        "server": health, "machine": describe(machine(default_threads())),
        # each answered request, in the order sent: what the percentiles are made of (a burst
        # of clients starting together shows in the first ones' waits)
        "requests": [{"client": r["client"], "start_s": round(r["start"], 2),
                      "ttft_s": None if r["ttft"] is None else round(r["ttft"], 2),
                      "latency_s": round(r["latency"], 2), "tokens": r["tokens"],
                      "turn": r["turn"], "cached": r["cached"]}
                     for r in sorted(ok, key=lambda r: r["start"])],
    }
    if args.hostile:
        for name, hostile in (("calm", False), ("hostile", True)):
            t = [r["ttft"] for r in ok if r["hostile"] == hostile and r["ttft"] is not None]
            h = [p for on, p in probes if on == hostile]
            summary[name] = {"requests": len(t), "ttft_p50_s": round(percentile(t, 0.5), 2),
                             "ttft_p95_s": round(percentile(t, 0.95), 2),
                             "health_p50_s": round(percentile(h, 0.5), 3),
                             "health_max_s": round(max(h, default=float("nan")), 3)}
        summary["hostile"].update(big)
        # each hostile-half request against the calm-half one with the same client and prompt
        calm = {(r["client"], r["seq"]): r["ttft"] for r in ok if not r["hostile"]}
        delta = [r["ttft"] - calm[r["client"], r["seq"]] for r in ok if r["hostile"]
                 and r["ttft"] is not None and calm.get((r["client"], r["seq"])) is not None]
        summary["ttft_delay_vs_twin_s"] = {"pairs": len(delta),
                                           "p50": round(percentile(delta, 0.5), 2),
                                           "p95": round(percentile(delta, 0.95), 2)}
    print(json.dumps(summary, indent=1))
    if args.markdown:
        cmd = "python scripts/load_test.py " + " ".join(sys.argv[1:])
        s = summary
        served = (f"llama-server -np {args.parallel} {args.peer_args or ''} on {args.model}"
                  if args.peer else
                  f"`specee-cpp serve` on {health['model']} (mode {health['mode']}), "
                  + (f"{args.parallel} requests at a time in one batch a step"
                     if args.parallel > 1 else "one request at a time"))
        what = {"code-edit": "code edits of HumanEval tasks 82-163",
                "conversation": "the dev set's two-turn MT-Bench conversations, turns up to "
                                "1,500 characters"}.get(args.traffic,
                                                        "Spec-Bench dev prompts, up to 1,500 "
                                                        "characters")
        counters = ("" if args.peer else
                    f"Server counters after the run: served {health['served']}, failed "
                    f"{health['failed']}, cancelled {health['cancelled']}, refused "
                    f"{health['refused']}. ")
        body = (f"Command: `{cmd}`\n\n"
                f"Machine: {s['machine']}. Server: {served}, from a bounded queue; "
                f"{s['clients']} clients each send streamed chat requests ({what}, greedy, "
                f"max_tokens {s['max_tokens']}) back to back "
                + (f"until each has sent {args.requests}.\n\n" if args.requests else
                   f"for {s['seconds']:.0f} s; requests already sent are waited for.\n\n")
                +
                "| clients | sent | completed | refused (429) | lost | req/s | tokens/s "
                "| latency p50 / p95 | first token p50 / p95 |\n"
                "|---|---|---|---|---|---|---|---|---|\n"
                f"| {s['clients']} | {s['sent']} | {s['completed']} | {s['refused_429']} | "
                f"{s['lost']} | {s['requests_per_s']} | {s['tokens_per_s']} | "
                f"{s['latency_p50_s']} / {s['latency_p95_s']} s | "
                f"{s['ttft_p50_s']} / {s['ttft_p95_s']} s |\n\n"
                f"{counters}Latency includes the wait in the queue: with fewer slots than "
                f"clients it grows with the number of clients; tokens/s is generated tokens "
                f"over the wall time, which also pays for each request's prompt prefill.\n")
        print(body)
    if lost:
        sys.exit(f"error: {lost} requests lost")


if __name__ == "__main__":
    main()
