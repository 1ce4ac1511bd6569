"""Load model files and generate from each one in a child process of its own, so that a crash or a hang is a result
to report rather than the end of the test run.

Run as a script, with the jobs as JSON on stdin ({"timeout": seconds, "jobs": [{"path", "prompt", "max_tokens"}]}):
it imports the engine once, then forks one child per job and prints one JSON line per job, in order, with the
seconds it took and its outcome:
- "generated": the model loaded and generated `token_ids` (greedy, end-of-sequence ignored);
- "refused": a ModelLoadError or InvalidParameterError, with its type and message;
- "leaked": any other exception, with its traceback (an error from deep inside, not one tokenriver raised on purpose);
- "crashed": the child died of a signal (`signal` names it);
- "hung": the child did not finish within the timeout and was killed.

The parent only imports and forks: it runs no kernel, so no OpenMP thread pool exists to be lost in a child.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from tokenriver.engine.llm import LLM
from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.params import SamplingParams

# What a child sends back is cut to this many characters, well inside a pipe's buffer: the parent reads it only once
# the child has exited.
MAX_REPORT_CHARS = 8000


def run_job(job: dict) -> dict:
    """Load job["path"] and generate job["max_tokens"] greedy tokens from job["prompt"]."""
    try:
        llm = LLM(job["path"], num_threads=1, max_num_kv_tokens=512)
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
        (output,) = llm.generate([job["prompt"]], params, use_tqdm=False)
    except (ModelLoadError, InvalidParameterError) as error:
        return {"outcome": "refused", "error_type": type(error).__name__, "message": error.message}
    except Exception as error:  # everything else is what the test looks for: report it, with where it came from
        return {"outcome": "leaked", "error_type": type(error).__name__, "message": traceback.format_exc()}
    return {"outcome": "generated", "token_ids": list(output.outputs[0].token_ids)}


def run_in_child(job: dict, timeout: float) -> dict:
    """run_job in a forked child; a signal or the timeout becomes the outcome."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanup
        os.close(read_end)
        report = json.dumps(run_job(job))
        if len(report) > MAX_REPORT_CHARS:
            report = json.dumps({"outcome": "leaked", "error_type": "report", "message": report[:MAX_REPORT_CHARS]})
        os.write(write_end, report.encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    status = None
    while status is None:
        finished, code = os.waitpid(pid, os.WNOHANG)
        if finished:
            status = code
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return {"outcome": "hung", "timeout": timeout}
        else:
            time.sleep(0.01)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read()
    if os.WIFSIGNALED(status):
        return {"outcome": "crashed", "signal": signal.Signals(os.WTERMSIG(status)).name}
    if not report:
        return {"outcome": "crashed", "signal": None, "exit_status": os.waitstatus_to_exitcode(status)}
    return json.loads(report)


def main() -> None:
    request = json.load(sys.stdin)
    for job in request["jobs"]:
        start = time.monotonic()
        outcome = run_in_child(job, request["timeout"])
        print(json.dumps(outcome | {"seconds": round(time.monotonic() - start, 3)}), flush=True)


if __name__ == "__main__":
    main()
