"""Run code an LLM wrote, safely: in a fresh sandbox with no network, a time limit and a memory
limit, and report what it printed and how it ended. The sandbox is deleted afterwards.

    HANGAR_URL=http://127.0.0.1:8000 HANGAR_TOKEN=hgr_… python run_llm_code.py [--image busybox]
"""

from __future__ import annotations

import argparse

from hangar_sdk import Sandbox

# What a model answered when asked for "a script that prints the first ten primes" (any
# language the image runs: sh here, so that the smallest image will do).
LLM_CODE = """\
n=2; found=0
while [ $found -lt 10 ]; do
  d=2; prime=1
  while [ $((d * d)) -le $n ]; do
    if [ $((n % d)) -eq 0 ]; then prime=0; break; fi
    d=$((d + 1))
  done
  if [ $prime -eq 1 ]; then printf '%s ' $n; found=$((found + 1)); fi
  n=$((n + 1))
done
echo
"""


def run_untrusted(code: str, *, image: str, interpreter: str = "sh", timeout_s: float = 30) -> int:
    with Sandbox.create(image=image, timeout_s=120, memory_mb=256, network="none") as sb:
        sb.files.write("/code/main", code)
        r = sb.exec([interpreter, "/code/main"], cwd="/code", timeout_s=timeout_s,
                    on_stdout=lambda s: print(s, end=""))  # fmt: skip
        if r.timed_out:
            print(f"killed after {timeout_s} s")
        print(f"exit code {r.exit_code} in {r.duration_ms:.0f} ms; stderr: {r.stderr.strip() or '(none)'}")
        return r.exit_code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--image", default="busybox")
    args = parser.parse_args()
    raise SystemExit(run_untrusted(LLM_CODE, image=args.image))
