#!/usr/bin/env python3
"""Runs every shell command shown in keel's Markdown documentation, so the docs cannot rot.

    doc_commands.py --keel PATH/TO/keel [--keel-demo PATH/TO/keel-demo] [--root SOURCE_DIR]
                    [FILE.md ...]

Without files it checks README.md and docs/*.md under --root.

The convention (docs/README.md repeats it for writers):
  * Every fenced code block names its language. ```sh blocks are run; any other language
    (```text for usage synopses and output, ```cpp, ```cmake, ...) is shown, never run. A fence
    without a language is an error, so a command cannot hide in an untagged block.
  * A ```sh block is a list of commands: a line ending in a backslash continues on the next line;
    blank lines and lines starting with # are skipped; a comment after a command is fine.
  * A command ending in `&` (a server) is started in the background; when it names a port
    (--listen HOST:PORT, --port PORT) the next command waits until that port accepts
    connections. Background commands are stopped (SIGTERM, then SIGKILL) at the end of the block.
  * `<!-- doc-test: skip REASON -->` on the line before the fence leaves the block out (for
    `make test`, which CI runs, or commands that need another machine). The reason is printed.
  * Relative links ([text](docs/x.md), [text](x.md#part)) must name files that exist.
  * `<!-- doc-test: same-as PATH -->` before a code block (```cpp) checks that the block is,
    line for line after removing common indentation, the part of PATH (relative to --root)
    between the lines `// --- README.md example ---` and `// --- end of the README.md example
    ---`. PATH is a program that `make test` builds and runs, so the snippet compiles.

Each file runs in a fresh temporary directory, its blocks in order (files written by one block
are there for the next), with the keel under test on PATH and linked as build/bin/keel (and
keel-demo, the showroom program, as build/bin/keel-demo when --keel-demo names it). When
possible the whole run happens in a private network namespace (unshare -n), so the fixed ports
the docs show (8080, 9000, ...) never collide with other tests running at the same time.

curl runs with --fail-with-body (from $HOME/.curlrc), so an HTTP error answer fails the command
too. A command that exits non-zero (or runs longer than 60 s) fails the test with FILE:LINE, the
command and the end of its output. Exit status: 0 all passed, 1 a command failed, 2 bad usage.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

COMMAND_TIMEOUT = 60  # seconds, per foreground command
READY_TIMEOUT = 15  # seconds for a background server to accept connections
SKIP_MARKER = re.compile(r"<!--\s*doc-test:\s*skip\b\s*(.*?)\s*-->")
SAME_AS_MARKER = re.compile(r"<!--\s*doc-test:\s*same-as\s+(\S+)\s*-->")
SNIPPET_BEGIN = "// --- README.md example ---"
SNIPPET_END = "// --- end of the README.md example ---"
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")


class Command:
    def __init__(self, path, line, text):
        self.path = path
        self.line = line
        self.text = text

    def where(self):
        return f"{self.path}:{self.line}"


class Block:
    def __init__(self, path, line, language, skip_reason):
        self.path = path
        self.line = line
        self.language = language
        self.skip_reason = skip_reason
        self.same_as = None
        self.text = []
        self.commands = []


def strip_comment(text):
    """The command without a trailing shell comment (a # outside quotes after a blank)."""
    quote = None
    prev = " "
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            return text[:i].rstrip()
        prev = ch
    return text.rstrip()


def parse(path, display):
    """Returns (blocks, errors)."""
    blocks, errors = [], []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, language = m.group(2), m.group(3)
        start = i + 1  # 1-based line of the fence
        skip = same_as = None
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("<!--"):
            s = SKIP_MARKER.search(lines[j])
            if s:
                skip = s.group(1) or "no reason given"
            s = SAME_AS_MARKER.search(lines[j])
            if s:
                same_as = s.group(1)
            j -= 1
        if not language:
            errors.append(f"{display}:{start}: a code block without a language: write ```sh to "
                          "have its commands run by the doc test, ```text to only show it")
        block = Block(display, start, language, skip)
        block.same_as = same_as
        i += 1
        pending, pending_line = "", 0
        while i < len(lines) and not lines[i].strip().startswith(fence[:3]):
            raw = lines[i]
            block.text.append(raw)
            if language == "sh":
                if pending:
                    pending += "\n" + raw
                elif raw.strip() and not raw.strip().startswith("#"):
                    pending, pending_line = raw, i + 1
                if pending and not strip_comment(pending).endswith("\\"):
                    block.commands.append(Command(display, pending_line, pending))
                    pending = ""
            i += 1
        if pending:
            block.commands.append(Command(display, pending_line, pending))
        if i >= len(lines):
            errors.append(f"{display}:{start}: the code block is never closed")
        blocks.append(block)
        i += 1
    return blocks, errors


LINK = re.compile(r"\]\(([^)\s]+)\)")


def check_links(path, display):
    """Errors for relative links to files that do not exist (fenced blocks excluded)."""
    errors = []
    inside = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                inside = not inside
                continue
            if inside:
                continue
            for m in LINK.finditer(line):
                target = m.group(1).split("#", 1)[0]
                if not target or re.match(r"^[a-z]+:", target):
                    continue
                if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                    errors.append(f"{display}:{number}: the link to {m.group(1)} names no file")
    return errors


def dedent(lines):
    lines = list(lines)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return [l[indent:].rstrip() for l in lines]


def check_same_as(block, root):
    """Returns an error message when the block differs from its program's marked part."""
    path = os.path.join(root, block.same_as)
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read().split("\n")
    except OSError as e:
        return f"{block.path}:{block.line}: same-as {block.same_as}: {e.strerror}"
    begin = [k for k, l in enumerate(source) if l.strip() == SNIPPET_BEGIN]
    end = [k for k, l in enumerate(source) if l.strip() == SNIPPET_END]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        return (f"{block.path}:{block.line}: same-as {block.same_as}: expected one "
                f"'{SNIPPET_BEGIN}' line and one '{SNIPPET_END}' line after it")
    want = dedent(source[begin[0] + 1:end[0]])
    have = dedent(block.text)
    if want == have:
        return None
    for k, (w, h) in enumerate(zip(want, have)):
        if w != h:
            return (f"{block.path}:{block.line}: differs from {block.same_as} at snippet line "
                    f"{k + 1}:\n    doc:     {h}\n    program: {w}")
    return (f"{block.path}:{block.line}: differs from {block.same_as}: {len(have)} lines in the "
            f"doc, {len(want)} in the program")


def ports_of(command):
    ports = []
    for m in re.finditer(r"--(?:listen|port)[ =](?:[\w.\[\]:-]*:)?(\d+)\b", command):
        if int(m.group(1)) != 0:
            ports.append(int(m.group(1)))
    return ports


def wait_for_port(port, proc):
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def tail(text, lines=15):
    out = text.strip().split("\n")
    return "\n".join("    | " + line for line in out[-lines:])


def stop(background):
    for proc, _, _ in background:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc, _, _ in background:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_block(block, cwd, env, failures):
    """Runs the block's commands in order; stops the block at its first failure."""
    background = []
    ran = 0
    try:
        for cmd in block.commands:
            text = strip_comment(cmd.text)
            is_background = text.endswith("&") and not text.endswith("&&")
            print(f"  {cmd.where()}: {cmd.text.splitlines()[0]}"
                  + (" ..." if "\n" in cmd.text else ""), flush=True)
            ran += 1
            if is_background:
                log = tempfile.TemporaryFile(dir=cwd)
                proc = subprocess.Popen(["bash", "-c", text[:-1]], cwd=cwd, env=env,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                background.append((proc, log, cmd))
                for port in ports_of(text):
                    if not wait_for_port(port, proc):
                        log.seek(0)
                        output = log.read().decode(errors="replace")
                        failures.append(f"{cmd.where()}: background command did not accept "
                                        f"connections on port {port} (exit "
                                        f"{proc.poll()}):\n    $ {cmd.text}\n{tail(output)}")
                        return ran
                continue
            proc = subprocess.Popen(["bash", "-c", cmd.text], cwd=cwd, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=COMMAND_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                failures.append(f"{cmd.where()}: command still running after "
                                f"{COMMAND_TIMEOUT} s:\n    $ {cmd.text}\n"
                                f"{tail(out.decode(errors='replace'))}")
                return ran
            output = out.decode(errors="replace")
            if proc.returncode != 0:
                failures.append(f"{cmd.where()}: command failed (exit {proc.returncode}):\n"
                                f"    $ {cmd.text}\n{tail(output)}")
                return ran
        # A background server that died on its own is a failure too.
        for proc, log, cmd in background:
            code = proc.poll()
            if code is not None and code != 0:
                log.seek(0)
                output = log.read().decode(errors="replace")
                failures.append(f"{cmd.where()}: background command exited {code}:\n"
                                f"    $ {cmd.text}\n{tail(output)}")
        return ran
    finally:
        stop(background)


def enter_network_namespace():
    """Re-executes this script in a private network namespace with loopback up, when possible."""
    if os.environ.get("KEEL_DOC_TEST_NETNS") or not shutil.which("unshare"):
        return
    env = dict(os.environ, KEEL_DOC_TEST_NETNS="1")
    inner = 'ip link set lo up && exec "$@"'
    for flags in (["-n"], ["-r", "-n"]):
        probe = subprocess.run(["unshare", *flags, "sh", "-c", "ip link set lo up"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if probe.returncode == 0:
            os.execvpe("unshare", ["unshare", *flags, "sh", "-c", inner, "sh",
                                   sys.executable, *sys.argv], env)
    print("note: no private network namespace (unshare -n failed); using the host's loopback")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keel", required=True, help="the keel binary under test")
    parser.add_argument("--keel-demo", help="the keel-demo binary (demo/) the docs also run")
    parser.add_argument("--root", default=os.getcwd(), help="the source tree (README.md, docs/)")
    parser.add_argument("--no-netns", action="store_true", help="stay in the host's network")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()

    keel = os.path.abspath(args.keel)
    if not os.access(keel, os.X_OK):
        print(f"doc test: --keel {args.keel} is not an executable", file=sys.stderr)
        return 2
    keel_demo = os.path.abspath(args.keel_demo) if args.keel_demo else None
    if keel_demo and not os.access(keel_demo, os.X_OK):
        print(f"doc test: --keel-demo {args.keel_demo} is not an executable", file=sys.stderr)
        return 2
    if not args.no_netns:
        enter_network_namespace()

    root = os.path.abspath(args.root)
    files = args.files
    if not files:
        files = [os.path.join(root, "README.md")]
        docs = os.path.join(root, "docs")
        files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))

    failures, errors = [], []
    commands = blocks_run = blocks_skipped = 0
    for path in files:
        display = os.path.relpath(path, root) if path.startswith(root + os.sep) else path
        blocks, parse_errors = parse(path, display)
        errors += parse_errors
        errors += check_links(path, display)
        for block in blocks:
            if block.same_as:
                message = check_same_as(block, root)
                if message:
                    errors.append(message)
                else:
                    print(f"{block.path}:{block.line}: the same as {block.same_as}")
        runnable = [b for b in blocks if b.language == "sh"]
        if not runnable:
            continue
        print(f"{display}:", flush=True)
        with tempfile.TemporaryDirectory(prefix="keel-doc-test.") as work:
            bindir = os.path.join(work, "build", "bin")
            os.makedirs(bindir)
            os.symlink(keel, os.path.join(bindir, "keel"))
            if keel_demo:
                os.symlink(keel_demo, os.path.join(bindir, "keel-demo"))
            env = dict(os.environ)
            env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
            env["HOME"] = work
            env["TMPDIR"] = work
            with open(os.path.join(work, ".curlrc"), "w", encoding="utf-8") as rc:
                rc.write("fail-with-body\n")  # an HTTP error fails the command
            for block in runnable:
                if block.skip_reason:
                    blocks_skipped += 1
                    print(f"  {block.path}:{block.line}: skipped ({block.skip_reason})")
                    continue
                blocks_run += 1
                commands += run_block(block, work, env, failures)

    for message in errors + failures:
        print(message, file=sys.stderr)
    print(f"doc test: {commands} commands in {blocks_run} blocks run, {blocks_skipped} blocks "
          f"skipped, {len(failures)} failed, {len(errors)} malformed blocks, out-of-date snippets or broken links")
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
