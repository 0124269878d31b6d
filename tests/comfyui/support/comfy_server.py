"""Run a real ComfyUI server as a subprocess and drive it over its HTTP API.

Everything the server writes (output, input, temp, user, its sqlite database, the log)
goes into a private temporary folder; models are found through a generated
``extra_model_paths.yaml``; the test-only nodes in ``tests/support/demo_nodes`` are
linked into a temporary ``custom_nodes`` folder that the same yaml adds. Custom nodes in
ComfyUI's own ``custom_nodes`` (e.g. the ``ringswap`` symlink to this pack) load too.

    with ComfyServer(comfy_dir, models_dir) as srv:
        pid = srv.queue(workflow)
        entry = srv.wait(pid, timeout=120)

Stdlib only (urllib, json).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

DEMO_NODES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_nodes")

# Model folder kinds mapped when a plain models directory is given.
_MODEL_KINDS = {
    "diffusion_models": "diffusion_models\nunet",
    "loras": "loras",
    "text_encoders": "text_encoders\nclip",
    "vae": "vae",
    "checkpoints": "checkpoints",
    "clip_vision": "clip_vision",
}


class ComfyServerError(RuntimeError):
    """Server failed to start / died / a prompt was rejected or failed."""


def free_port(host="127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _yaml_scalar(s: str) -> str:
    # JSON strings are valid YAML scalars (handles spaces, colons, backslashes).
    return json.dumps(s)


class ComfyServer:
    """ComfyUI server subprocess on 127.0.0.1.

    comfy_dir: the ComfyUI folder (holds main.py).
    models_dir_or_extra_paths: one of
      - a directory: used as a models root (``<dir>/diffusion_models``, ``loras``, ...);
      - a path to an existing ``*.yaml``: passed as an extra model paths config as is;
      - a dict ``{folder_kind: path or [paths]}`` (e.g. ``{"diffusion_models": d}``);
      - None: only ComfyUI's own model folders.
    port: None picks a free loopback port.
    cpu: pass ``--cpu`` (drop it to use CUDA).
    extra_args: further command-line arguments for main.py.
    extra_custom_nodes: further custom node package folders to link in.
    demo_nodes: link tests/support/demo_nodes in (default True).
    start_timeout: seconds to wait for /object_info to answer.
    front_end_root: a frontend's static folder to serve (default: an empty one, no frontend).
    """

    def __init__(self, comfy_dir, models_dir_or_extra_paths=None, port=None, cpu=True,
                 extra_args=(), *, extra_custom_nodes=(), demo_nodes=True,
                 start_timeout=90.0, env=None, keep_workdir=False, front_end_root=None):
        self.comfy_dir = os.path.abspath(os.fspath(comfy_dir))
        if not os.path.isfile(os.path.join(self.comfy_dir, "main.py")):
            raise FileNotFoundError(f"no ComfyUI main.py in {self.comfy_dir}")
        self.models = models_dir_or_extra_paths
        self.port = port
        self.cpu = cpu
        self.extra_args = list(extra_args)
        self.extra_custom_nodes = [os.path.abspath(os.fspath(p)) for p in extra_custom_nodes]
        if demo_nodes:
            self.extra_custom_nodes.insert(0, DEMO_NODES_DIR)
        self.start_timeout = start_timeout
        self.env = env
        self.keep_workdir = keep_workdir
        self.front_end_root = front_end_root
        self.proc = None
        self.workdir = None
        self.log_path = None
        self.client_id = uuid.uuid4().hex
        self._log_file = None

    # ----------------------------------------------------------------- layout
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output_dir(self) -> str:
        return os.path.join(self.workdir, "output")

    def _write_yaml(self) -> list:
        configs = []
        m = self.models
        entries = {}
        if m is None:
            pass
        elif isinstance(m, dict):
            for kind, paths in m.items():
                if isinstance(paths, (str, os.PathLike)):
                    paths = [paths]
                entries[kind] = "\n".join(os.path.abspath(os.fspath(p)) for p in paths)
        else:
            p = os.path.abspath(os.fspath(m))
            if os.path.isfile(p) and p.endswith((".yaml", ".yml")):
                configs.append(p)
            elif os.path.isdir(p):
                for kind, subs in _MODEL_KINDS.items():
                    entries[kind] = "\n".join(os.path.join(p, s) for s in subs.split("\n"))
            else:
                raise FileNotFoundError(f"models path {p} is neither a folder nor a yaml file")
        if self.extra_custom_nodes:
            cn = os.path.join(self.workdir, "custom_nodes")
            os.makedirs(cn, exist_ok=True)
            for src in self.extra_custom_nodes:
                name = os.path.basename(src.rstrip(os.sep))
                if src == DEMO_NODES_DIR:
                    name = "ringswap_demo_nodes"
                os.symlink(src, os.path.join(cn, name), target_is_directory=True)
            entries["custom_nodes"] = cn
        if entries:
            y = os.path.join(self.workdir, "extra_model_paths.yaml")
            with open(y, "w", encoding="utf-8") as f:
                f.write("ringswap_tests:\n")
                for kind, val in entries.items():
                    f.write(f"  {kind}: {_yaml_scalar(val)}\n")
            configs.insert(0, y)
        return configs

    def command(self) -> list:
        wd = self.workdir
        cmd = [sys.executable, "main.py",
               "--listen", "127.0.0.1", "--port", str(self.port),
               "--disable-auto-launch", "--disable-api-nodes",
               "--front-end-root", self.front_end_root or os.path.join(wd, "frontend"),
               "--output-directory", os.path.join(wd, "output"),
               "--input-directory", os.path.join(wd, "input"),
               "--temp-directory", wd,  # ComfyUI appends "temp"
               "--user-directory", os.path.join(wd, "user"),
               "--database-url", "sqlite:///:memory:"]
        if self.cpu:
            cmd.append("--cpu")
        for y in self._configs:
            cmd += ["--extra-model-paths-config", y]
        return cmd + self.extra_args

    # ------------------------------------------------------------- lifecycle
    def start(self):
        if self.proc is not None:
            raise ComfyServerError("server already started")
        self.workdir = tempfile.mkdtemp(prefix="ringswap_comfy_")
        for d in ("frontend", "output", "input", "user"):
            os.makedirs(os.path.join(self.workdir, d), exist_ok=True)
        if self.port is None:
            self.port = free_port()
        self._configs = self._write_yaml()
        self.log_path = os.path.join(self.workdir, "server.log")
        self._log_file = open(self.log_path, "wb")
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(self.command(), cwd=self.comfy_dir, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.monotonic()
        deadline = self.started_at + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ComfyServerError(f"ComfyUI exited with code {self.proc.returncode} "
                                       f"during startup; log tail:\n{tail}")
            try:
                self._request("GET", "/object_info/KSampler", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ComfyServerError(f"ComfyUI did not answer /object_info within "
                                       f"{self.start_timeout:.0f}s; log tail:\n{tail}")
            time.sleep(0.25)
        self.startup_s = time.monotonic() - self.started_at
        return self

    def stop(self, timeout=15.0):
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if not self.keep_workdir and self.workdir and os.path.isdir(self.workdir):
            # keep the log readable after stop: copy its text first
            try:
                self._final_log = self.log_text()
            except OSError:
                pass
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # ------------------------------------------------------------------ http
    def _request(self, method, path, body=None, timeout=30.0):
        data = None
        headers = {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, headers=headers,
                                     method=method)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def object_info(self, node_class=None) -> dict:
        path = "/object_info" + (f"/{node_class}" if node_class else "")
        return self._request("GET", path, timeout=60)

    def queue(self, prompt: dict) -> str:
        """Queue an API-format workflow; returns its prompt_id. Raises
        ComfyServerError with ComfyUI's validation errors if it is rejected."""
        try:
            r = self._request("POST", "/prompt",
                              {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.dumps(json.loads(detail), indent=1)
            except ValueError:
                pass
            raise ComfyServerError(f"ComfyUI rejected the prompt (HTTP {e.code}):\n"
                                   f"{detail}") from None
        if "prompt_id" not in r:
            raise ComfyServerError(f"unexpected /prompt answer: {r}")
        return r["prompt_id"]

    def history(self, prompt_id=None):
        return self._request("GET", "/history" + (f"/{prompt_id}" if prompt_id else ""))

    def wait(self, prompt_id: str, timeout: float = 120.0, poll: float = 0.2) -> dict:
        """Wait until the prompt finished; returns its /history entry. Raises
        ComfyServerError with ComfyUI's exception message (and traceback) if the
        execution failed, TimeoutError (after interrupting it) on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            entry = (self.history(prompt_id) or {}).get(prompt_id)
            if entry is not None:
                status = entry.get("status") or {}
                if status.get("status_str") == "error":
                    raise ComfyServerError(_format_error(prompt_id, status))
                if status.get("completed", True) or status.get("status_str") == "success":
                    return entry
            if self.proc is None or self.proc.poll() is not None:
                raise ComfyServerError(f"ComfyUI died while running {prompt_id}; "
                                       f"log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                try:
                    self.interrupt()
                finally:
                    pass
                raise TimeoutError(f"prompt {prompt_id} not finished after {timeout}s; "
                                   f"log tail:\n{self.log_tail()}")
            time.sleep(poll)

    def run(self, prompt: dict, timeout: float = 120.0) -> dict:
        """queue + wait."""
        return self.wait(self.queue(prompt), timeout=timeout)

    def interrupt(self):
        self._request("POST", "/interrupt", {})

    def free(self, unload_models: bool = True, free_memory: bool = False) -> None:
        """POST /free: ComfyUI's "unload models" (free_memory: also drop its node cache),
        followed by its gc. It only sets flags, which the prompt worker reads after its
        next queue item (or at once when idle)."""
        self._request("POST", "/free", {"unload_models": unload_models, "free_memory": free_memory})

    def output_files(self, entry: dict, kind=None) -> list:
        """Absolute paths of the files a history entry lists in its outputs
        (kind: e.g. "latents", "images"; None = all)."""
        paths = []
        for node_out in (entry.get("outputs") or {}).values():
            for k, items in node_out.items():
                if kind is not None and k != kind:
                    continue
                for it in items if isinstance(items, list) else []:
                    if isinstance(it, dict) and "filename" in it:
                        base = self.output_dir if it.get("type", "output") == "output" \
                            else os.path.join(self.workdir, "temp")
                        paths.append(os.path.join(base, it.get("subfolder", ""),
                                                  it["filename"]))
        return paths

    # ------------------------------------------------------------------- log
    def log_text(self) -> str:
        if self.log_path and os.path.exists(self.log_path):
            if self._log_file is not None:
                self._log_file.flush()
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        return getattr(self, "_final_log", "")

    def log_tail(self, n=60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


def _format_error(prompt_id, status) -> str:
    for kind, msg in status.get("messages") or []:
        if kind == "execution_error":
            tb = "".join(msg.get("traceback") or [])
            return (f"prompt {prompt_id} failed in node {msg.get('node_id')} "
                    f"({msg.get('node_type')}): {msg.get('exception_type')}: "
                    f"{msg.get('exception_message')}\n{tb}")
        if kind == "execution_interrupted":
            return f"prompt {prompt_id} was interrupted (node {msg.get('node_id')})"
    return f"prompt {prompt_id} failed: {json.dumps(status)}"
