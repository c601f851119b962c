"""wrk, the load generator of the hop benchmark: a Lua script for a load, one bounded run, its numbers.

wrk (C, epoll, one thread) costs far less per request than the Python servers it drives, so it is not
the bottleneck. The script's ``done()`` hook prints one ``WRK_JSON {...}`` line (counts, latency
percentiles in microseconds), which is what ``parse`` reads: no scraping of wrk's human output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MARKER = "WRK_JSON "

# Bodies are read from files (a 2 MB body is no Lua literal); more than one body: each request
# takes the next, round robin (a Lua call a request, so only where distinct bodies matter).
_SCRIPT = """\
local bodies = {}
for i, path in ipairs({%(paths)s}) do
  local f = assert(io.open(path, "rb"))
  bodies[i] = f:read("*a")
  f:close()
end
wrk.method = "POST"
%(headers)s
wrk.body = bodies[1]
if #bodies > 1 then
  local n = 0
  request = function()
    n = n + 1
    return wrk.format(nil, nil, nil, bodies[(n - 1) %% #bodies + 1])
  end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%(marker)s{"requests": %%.0f, "duration_us": %%.0f, "bytes": %%.0f, "connect_errors": %%.0f, ' ..
    '"read_errors": %%.0f, "write_errors": %%.0f, "timeouts": %%.0f, "non_2xx": %%.0f, ' ..
    '"p50_us": %%.0f, "p90_us": %%.0f, "p99_us": %%.0f, "max_us": %%.0f}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    non_2xx: int
    socket_errors: int  # connect, read, write errors and timeouts

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def lua_script(bodies: Sequence[Path], headers: Mapping[str, str]) -> str:
    """A wrk script that POSTs ``bodies`` (files) with ``headers``, and prints its result as JSON."""
    paths = ", ".join(_lua_string(str(p)) for p in bodies)
    lines = "\n".join(f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items())
    return _SCRIPT % {"paths": paths, "headers": lines, "marker": MARKER}


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse(stdout: str) -> WrkResult:
    """The result in wrk's output; ValueError when the script's line is missing (wrk failed)."""
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            raw = json.loads(line[len(MARKER) :])
            return WrkResult(
                requests=int(raw["requests"]),
                duration_s=raw["duration_us"] / 1e6,
                p50_ms=raw["p50_us"] / 1000,
                p90_ms=raw["p90_us"] / 1000,
                p99_ms=raw["p99_us"] / 1000,
                max_ms=raw["max_us"] / 1000,
                non_2xx=int(raw["non_2xx"]),
                socket_errors=sum(int(raw[k]) for k in ("connect_errors", "read_errors", "write_errors", "timeouts")),
            )
    raise ValueError(f"no {MARKER.strip()} line in wrk's output:\n{stdout[-2000:]}")


def wrk_command(url: str, script: Path, *, connections: int, duration_s: int, timeout_s: int = 10) -> list[str]:
    return [
        wrk_path(), "-t1", f"-c{connections}", f"-d{duration_s}s", f"--timeout={timeout_s}s", "-s", str(script), url,
    ]  # fmt: skip


def run(url: str, script: Path, *, connections: int, duration_s: int) -> WrkResult:
    """One run of wrk against ``url``; it stops by itself after ``duration_s`` (a hard limit kills it)."""
    command = wrk_command(url, script, connections=connections, duration_s=duration_s)
    done = subprocess.run(command, capture_output=True, text=True, timeout=duration_s + 30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk exited {done.returncode}: {done.stderr.strip() or done.stdout[-2000:]}")
    return parse(done.stdout)


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise RuntimeError("wrk is not installed: `make bench-deps` installs Debian's (apt-get install wrk)")
    return path
