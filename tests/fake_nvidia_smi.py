"""A stand-in for ``nvidia-smi`` on machines without NVIDIA GPUs (tests only).

Answers the two queries the router makes, from the JSON file named by ``FAKE_NVIDIA_SMI``::

    {"gpus": [[index, uuid, name, total_mib], ...],
     "apps": [[pid, uuid, used_mib], ...],
     "per_process": {"name": "llama-server", "uuid": "GPU-0", "used_mib": 100},
     "exit": 0}

``per_process`` reports every running process with that name as using ``used_mib`` on that GPU
(or on the GPU given by its ``--main-gpu`` argument, when it has one).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil


def main(argv: list[str]) -> int:
    config = json.loads(Path(os.environ["FAKE_NVIDIA_SMI"]).read_text())
    if config.get("exit"):
        return int(config["exit"])
    query = next((a for a in argv if a.startswith("--query-")), "")
    if query.startswith("--query-gpu="):
        for index, uuid, name, total in config.get("gpus", []):
            print(f"{index}, {uuid}, {name}, {total}")
    elif query.startswith("--query-compute-apps="):
        for pid, uuid, used in config.get("apps", []):
            print(f"{pid}, {uuid}, {used}")
        rule = config.get("per_process")
        if rule:
            uuids = [g[1] for g in config.get("gpus", [])]
            for proc in psutil.process_iter(["name", "cmdline"]):
                if proc.info["name"] != rule["name"]:
                    continue
                cmdline = proc.info["cmdline"] or []
                uuid = rule["uuid"]
                if "--main-gpu" in cmdline:
                    uuid = uuids[int(cmdline[cmdline.index("--main-gpu") + 1])]
                print(f"{proc.pid}, {uuid}, {rule['used_mib']}")
    else:
        print(f"fake nvidia-smi: unsupported arguments {argv}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
