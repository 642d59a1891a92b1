"""Process-level settings: command-line flags over environment (``LLAMA_ROUTER_*``) over defaults.

Per-model behaviour lives in presets (``presets.py``); this module holds only what the router
process itself needs. Defaults are named constants so docs and code agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..errors import ConfigurationError as ConfigurationError  # its home: errors
from .keyfile import ApiKey, KeyFileInvalid
from .keyfile import parse_file as parse_key_file

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MODELS_MAX = 4
DEFAULT_LOAD_TIMEOUT_S = 300.0
DEFAULT_STOP_TIMEOUT_S = 10.0
DEFAULT_WAIT_BUDGET_S = 120.0
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
DEFAULT_LOG_LINES = 1000
DEFAULT_MAX_QUEUE = 1000
DEFAULT_FAIRNESS_S = 10.0
DEFAULT_CRASH_LOOP_LIMIT = 5
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0  # llama-server's own read timeout
HEALTH_POLL_INTERVAL_S = 0.02
DEFAULT_LIVENESS_INTERVAL_S = 2.0
DEFAULT_LIVENESS_TIMEOUT_S = 3.0
DEFAULT_LIVENESS_MISSES = 3
DEFAULT_PEER_DNS_INTERVAL_S = 10.0
DEFAULT_STATE_BUDGET = "10G"  # saved slot states (warm swaps), least recently used dropped
MAX_STATE_BUDGET_BYTES = 1 << 50  # 1 PiB: past any disk, short of a number that means none
DEFAULT_CORS_ORIGINS = "*"  # llama-server's default: any origin, inference routes only


class ApiKeysInvalid(ConfigurationError):
    """The API key settings give no key set to serve with. ``problems``: every one, a key
    file's bad line as ``FILE:LINE: problem``, anything else as ``FILE: problem`` or naming
    its option; none quotes a key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid API keys:\n" + "\n".join(f"  {p}" for p in problems))


class Settings(BaseSettings):
    """Everything ``llama-router serve`` is configured by.

    Environment variables use the prefix ``LLAMA_ROUTER_`` (``LLAMA_ROUTER_PORT=9000``); list
    values are comma separated. Command-line flags win over the environment.
    """

    model_config = SettingsConfigDict(env_prefix="LLAMA_ROUTER_", extra="forbid")

    host: str = Field(DEFAULT_HOST, description="addresses to listen on, comma separated "
                      "(listen.py)")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    presets: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    models_dir: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    models_max: int = Field(DEFAULT_MODELS_MAX, description="<= 0 means unlimited")
    models_autoload: bool = True
    api_key: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    api_key_file: Path | None = None
    llama_server: Path | None = None
    load_timeout: float = Field(DEFAULT_LOAD_TIMEOUT_S, gt=0)
    stop_timeout: float = Field(DEFAULT_STOP_TIMEOUT_S, ge=0)
    wait_budget: float = Field(DEFAULT_WAIT_BUDGET_S, gt=0)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    body_timeout: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0,
                                description="seconds a request body may pause between chunks "
                                "(then 408)")
    upstream_timeout: float = Field(DEFAULT_UPSTREAM_TIMEOUT_S, gt=0,
                                    description="seconds a proxied request may wait for its "
                                    "upstream's response head (then 504)")
    log_lines: int = Field(DEFAULT_LOG_LINES, gt=0)
    log_level: str = "info"
    idle_timeout: float = Field(0.0, ge=0, description="unload models idle this long; 0: never")
    memory_budget: str | None = Field(
        None, description="bytes all children may use (e.g. 24G); default: RAM minus a "
        "margin; 'off' disables the check")
    state_dir: Path | None = Field(
        None, description="warm swaps: save a model's slots here before its children stop "
        "(eviction, unload, idle TTL) and restore them into its next ones; default: off")
    state_budget: str = Field(DEFAULT_STATE_BUDGET, description="bytes the saved slot "
                              "states may take in --state-dir (least recently used dropped)")
    gpu_memory_budget: str | None = Field(
        None, description="bytes each GPU's children may use: 'auto' (default: the GPU's "
        "memory less 1 GiB), 'off', a size for every GPU, or INDEX=SIZE,...")
    max_queue: int = Field(DEFAULT_MAX_QUEUE, gt=0)
    fairness: float = Field(DEFAULT_FAIRNESS_S, gt=0)
    crash_loop_limit: int = Field(DEFAULT_CRASH_LOOP_LIMIT, ge=1)
    liveness_interval: float = Field(
        DEFAULT_LIVENESS_INTERVAL_S, ge=0,
        description="seconds between health checks of each serving child; 0: none")
    liveness_timeout: float = Field(DEFAULT_LIVENESS_TIMEOUT_S, gt=0,
                                    description="seconds a health check may take")
    liveness_misses: int = Field(DEFAULT_LIVENESS_MISSES, ge=1,
                                 description="failed health checks in a row that kill a child")
    shutdown_grace: float = Field(DEFAULT_SHUTDOWN_GRACE_S, gt=0,
                                  description="seconds in-flight requests get at shutdown")
    cpu_sharing: bool = Field(True, description="place CPU children on the cores and let "
                              "models take turns (cpus.py, cpugate.py)")
    child_args: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webui: bool = Field(True, description="serve llama.cpp's web UI at / (false: none)")
    webui_path: Path | None = Field(None, description="serve the web UI built in this folder "
                                    "(with index.html) instead of the installed one")
    node_name: str = Field("", description="this router's name as a node among peers "
                           "(/models, metrics' node label); default: the host name")
    peer: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="other routers to front: http://host:port")
    peer_api_key_file: Path | None = Field(None, description="file with the bearer key sent "
                                           "to peers (one line)")
    peer_dns: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="NAME:PORT whose A/AAAA records are the peers "
                                          "(a headless Service)")
    peer_dns_interval: float = Field(DEFAULT_PEER_DNS_INTERVAL_S, gt=0,
                                     description="seconds between resolutions of --peer-dns")
    peer_prefix: bool = Field(False, description="list peers' models as NODE/MODEL")
    default_model: str | None = Field(
        None, description="the model (id or alias) that requests naming none go to; without "
        "it, a router with exactly one model uses that one (defaults.py)")
    unknown_model_to_default: bool = Field(
        False, description="send proxied requests naming a model nobody serves to the default "
        "model instead of answering 404")
    cors_origins: str = Field(DEFAULT_CORS_ORIGINS, description="what pages of other origins "
                              "may use: *, localhost (inference), origins named one by one "
                              "(every route), or none (cors.py)")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        """``LLAMA_ROUTER_API_KEY=`` (empty, as in an env file) is unset; a value that holds
        no key (" , ") becomes ``[""]``, which ``all_api_keys`` refuses."""
        if isinstance(value, str):
            if value == "":
                return []
            return [part.strip() for part in value.split(",") if part.strip()] or [""]
        return value

    @field_validator("presets", "models_dir", "child_args", "peer", "peer_dns", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("webui_path", "default_model", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # LLAMA_ROUTER_WEBUI_PATH= in an env file

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        """``LLAMA_ROUTER_HOST=`` (empty, as in an env file) is unset; otherwise the list
        must hold an address (``listen.parse_hosts``)."""
        from .listen import parse_hosts

        if value == "":
            return DEFAULT_HOST
        parse_hosts(value)  # a ValueError becomes a validation error naming it
        return value

    def hosts(self) -> list[str]:
        """The addresses to listen on (``listen.parse_hosts``)."""
        from .listen import parse_hosts

        return parse_hosts(self.host)

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _check_cors_origins(cls, value: object) -> object:
        """``LLAMA_ROUTER_CORS_ORIGINS=`` (empty, as in an env file) is unset."""
        from .origins import CorsPolicy

        if value == "":
            return DEFAULT_CORS_ORIGINS
        if isinstance(value, str):
            CorsPolicy.parse(value)  # a ValueError becomes a validation error naming it
        return value

    @field_validator("memory_budget")
    @classmethod
    def _check_memory_budget(cls, value: str | None) -> str | None:
        from ..host.memory import parse_size

        if value is not None and value.strip().lower() not in ("off", "none", "0"):
            parse_size(value)  # a ValueError becomes a validation error naming the setting
        return value

    @field_validator("state_budget")
    @classmethod
    def _check_state_budget(cls, value: str) -> str:
        from ..host.memory import format_size, parse_size

        if parse_size(value) > MAX_STATE_BUDGET_BYTES:
            raise ValueError(f"{value!r} is more than the most a state directory may hold "
                             f"({format_size(MAX_STATE_BUDGET_BYTES)})")
        return value

    def state_budget_bytes(self) -> int:
        from ..host.memory import parse_size

        return parse_size(self.state_budget)

    @field_validator("gpu_memory_budget")
    @classmethod
    def _check_gpu_memory_budget(cls, value: str | None) -> str | None:
        from ..host.gpus import parse_budget

        parse_budget(value)
        return value

    def memory_budget_bytes(self) -> int | None:
        """The memory budget in bytes, or None when disabled."""
        from ..host.memory import default_budget_bytes, parse_size

        if self.memory_budget is None:
            return default_budget_bytes()
        if self.memory_budget.strip().lower() in ("off", "none", "0"):
            return None
        return parse_size(self.memory_budget)

    def all_api_keys(self) -> list[str]:
        """The keys to start with (``read_api_keys``); asking for keys and getting none
        (``--api-key ""``, ``LLAMA_ROUTER_API_KEY=" , "``, a key file of comments only) is an
        ``ApiKeysInvalid`` too: serving without authentication is never the silent result of
        a typo. (An empty ``LLAMA_ROUTER_API_KEY=`` is unset.)"""
        keys = self.read_api_keys()
        if self.api_keys_asked() and not keys:
            raise ApiKeysInvalid([f"{self.no_keys()}: refusing to start without "
                                  "authentication; set a key, or remove the option to serve "
                                  "without keys"])
        return keys

    def read_api_keys(self) -> list[str]:
        """The keys now: ``--api-key``'s (full access, team ``admin``), then
        ``--api-key-file``'s as the file reads now (one key per line, ``#`` comments, each
        optionally followed by its scope and policy, see ``keyfile.py``), each a
        ``keyfile.ApiKey`` whose repr hides it. The one reading of the keys: at start
        (``all_api_keys``) and at every reload of the key file (``reload``), which may find
        none (its caller decides what that means).

        A bad file is an ``ApiKeysInvalid`` with every problem, each naming the file and the
        line, never the key."""
        flag_keys = [key for key in self.api_key if key]
        keys: list[str] = [ApiKey(key) for key in flag_keys]  # full access
        path = self.api_key_file
        if path is None:
            return keys
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeysInvalid([f"{path}: {getattr(exc, 'strerror', None) or exc}"]
                                 ) from None
        try:
            return keys + parse_key_file(text, flag_keys=frozenset(flag_keys))
        except KeyFileInvalid as exc:
            raise ApiKeysInvalid([f"{path}:{number}: {problem}"
                                  for number, problem in exc.problems]) from None

    def api_keys_asked(self) -> bool:
        """Whether keys are asked for (``--api-key`` or ``--api-key-file`` given)."""
        return bool(self.api_key) or self.api_key_file is not None

    def no_keys(self) -> str:
        """What gave no key, when keys are asked for and none is read."""
        if self.api_key_file is not None:
            return f"{self.api_key_file}: gives no API key (empty, blank or only comments)"
        return "--api-key / LLAMA_ROUTER_API_KEY gives no API key (empty or blank)"


def describe(error: ValidationError) -> str:
    """What was wrong with the settings, one line a setting, each named as it is given: its
    flag and its environment variable (``--state-budget`` / ``LLAMA_ROUTER_STATE_BUDGET``),
    with the validator's own message (never pydantic's layout or links)."""
    lines = []
    for problem in error.errors(include_url=False):
        where = problem["loc"][0] if problem["loc"] else ""
        message = str(problem["msg"]).removeprefix("Value error, ")
        if isinstance(where, str) and where:
            name = f"--{where.replace('_', '-')} ({Settings.model_config['env_prefix']}" \
                   f"{where.upper()})"
            given = problem.get("input")
            if isinstance(given, (str, int, float)) and str(given) not in message:
                message = f"{message} (given {given!r})"
            lines.append(f"  {name}: {message}")
        else:
            lines.append(f"  {message}")
    return "\n".join(lines)
