"""Screenshot a titan_rl report (HTML) with headless Chromium, to check how it renders.

    python scripts/screenshot_report.py REPORT.html OUT.png [--width 1280] [--height 3000]

Needs a Chromium binary (Debian: `apt-get install -y chromium`); without one it prints
a message and exits 0 (skipped). Runs with --no-sandbox so it also works as root.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    env = os.environ.get("CHROMIUM")
    if env and shutil.which(env):
        return shutil.which(env)
    return next((shutil.which(c) for c in CANDIDATES if shutil.which(c)), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    if not os.path.isfile(args.html):
        print(f"screenshot: error: {args.html}: no such file", file=sys.stderr)
        return 2
    exe = find_chromium()
    if exe is None:
        print("screenshot: skipped: chromium not installed (apt-get install -y chromium, or set CHROMIUM=...)")
        return 0
    png = os.path.abspath(args.png)
    os.makedirs(os.path.dirname(png), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={args.width},{args.height}",
               "file://" + os.path.abspath(args.html)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"screenshot: error: chromium did not finish in {args.timeout:.0f}s", file=sys.stderr)
            return 1
    if proc.returncode != 0 or not os.path.isfile(png):
        print(f"screenshot: error: chromium exited {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
