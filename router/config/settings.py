"""Process-level settings: command-line flags over environment (``LLAMA_ROUTER_*``) over defaults.

Per-model behaviour lives in presets (``presets.py``); this module holds only what the router
process itself needs. Defaults are named constants so docs and code agree. Each setting is
declared once, as a field of ``Settings``; ``serve``'s flags are built from the fields
(``Flag``, ``cli.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
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
LOG_LEVELS = ("debug", "info", "warning", "error")


class ApiKeysInvalid(ConfigurationError):
    """The API key settings give no key set to serve with. ``problems``: every one, a key
    file's bad line as ``FILE:LINE: problem``, anything else as ``FILE: problem`` or naming
    its option; none quotes a key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid API keys:\n" + "\n".join(f"  {p}" for p in problems))


@dataclass(frozen=True)
class Flag:
    """A setting's flag of ``serve``: ``cli.py`` builds the command line from the fields of
    ``Settings`` that carry one, a field without one is set by its environment variable only.

    The flag is the field's name, ``--models-max`` for ``models_max``, taking one value of the
    field's type (of its items for a list, whose flag repeats); a bool's flag takes none and
    turns its default over: ``--no-webui`` for ``webui`` (default true), ``--peer-prefix``
    for ``peer_prefix`` (default false). Its help is the field's description, where
    ``{default}`` stands for the default; a bool's says what its flag does. ``metavar`` names
    the value in ``--help`` (default: the name in capitals), ``choices`` are the only values
    taken, ``aliases`` are other spellings, not shown."""

    metavar: str | None = None
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


class Settings(BaseSettings):
    """Everything ``llama-router serve`` is configured by.

    Environment variables use the prefix ``LLAMA_ROUTER_`` (``LLAMA_ROUTER_PORT=9000``); list
    values are comma separated. Command-line flags win over the environment.

    Each setting is declared here once: its name (and so its environment variable), type,
    default, checks and, where it has a ``Flag``, its flag and help. The fields are in the
    order an invalid configuration's problems are listed; ``cli.SERVE_HELP_ORDER`` is the
    order of ``serve --help``.
    """

    model_config = SettingsConfigDict(env_prefix="LLAMA_ROUTER_", extra="forbid")

    host: Annotated[str, Flag()] = Field(  # listen.py
        DEFAULT_HOST, description="addresses to listen on, comma separated: IPv4, IPv6 (::1), "
        ":: or host names (default {default})")
    port: Annotated[int, Flag()] = Field(DEFAULT_PORT, ge=0, le=65535,
                                         description="port to listen on (default {default})")
    presets: Annotated[list[Path], NoDecode, Flag("FILE", aliases=("--models-preset",))] = Field(
        default_factory=list, description="INI preset file (llama.cpp format); repeatable")
    models_dir: Annotated[list[Path], NoDecode, Flag("DIR")] = Field(
        default_factory=list,
        description="directory of GGUF models (llama.cpp layout); repeatable")
    models_max: Annotated[int, Flag("N")] = Field(
        DEFAULT_MODELS_MAX,
        description="most models loaded at once, <= 0 for no limit (default {default})")
    models_autoload: Annotated[bool, Flag()] = Field(
        True, description="do not load models on request; use POST /models/load")
    api_key: Annotated[list[str], NoDecode, Flag("KEY")] = Field(
        default_factory=list, repr=False,
        description="require this API key (comma list or repeat)")
    api_key_file: Annotated[Path | None, Flag("FILE")] = Field(  # keyfile.py
        None, description="file with one API key per line (# comments), each optionally "
        "scoped: KEY models=a,b-* role=infer|metrics|admin (README: API keys)")
    llama_server: Annotated[Path | None, Flag("PATH")] = Field(
        None, description="llama-server binary (default: $LLAMA_SERVER_BIN, PATH, then cache)")
    load_timeout: Annotated[float, Flag("S")] = Field(
        DEFAULT_LOAD_TIMEOUT_S, gt=0,
        description="seconds a child may take to become healthy (default {default})")
    stop_timeout: Annotated[float, Flag("S")] = Field(
        DEFAULT_STOP_TIMEOUT_S, ge=0,
        description="seconds between SIGTERM and SIGKILL when stopping (default {default})")
    wait_budget: Annotated[float, Flag("S")] = Field(
        DEFAULT_WAIT_BUDGET_S, gt=0,
        description="seconds a request may wait for its model (default {default})")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0,
                                description="larger request bodies get a 413")
    body_timeout: Annotated[float, Flag("S")] = Field(
        DEFAULT_BODY_TIMEOUT_S, gt=0,
        description="seconds a request body may pause between two chunks before the request "
        "ends with a 408 (default {default})")
    upstream_timeout: Annotated[float, Flag("S")] = Field(
        DEFAULT_UPSTREAM_TIMEOUT_S, gt=0,
        description="seconds a proxied request may wait for the response head of its child, "
        "peer or remote (a non-streamed answer's comes when its generation ends); then a 504 "
        "(default {default})")
    log_lines: int = Field(DEFAULT_LOG_LINES, gt=0,
                           description="lines of output kept per child (/logs)")
    log_level: Annotated[str, Flag(choices=LOG_LEVELS)] = "info"
    idle_timeout: Annotated[float, Flag("S")] = Field(
        0.0, ge=0, description="unload a model idle this many seconds (default {default}: "
        "never; preset: ttl)")
    memory_budget: Annotated[str | None, Flag("SIZE")] = Field(
        None, description="memory all children may use, e.g. 24G (default: RAM minus "
        "max(1 GiB, 10%); 'off' to count models only)")
    state_dir: Annotated[Path | None, Flag("DIR")] = Field(
        None, description="warm swaps: save a model's slots (prompt caches) here before its "
        "children stop, restore them when it loads again (default: off)")
    state_budget: Annotated[str, Flag("SIZE")] = Field(
        DEFAULT_STATE_BUDGET, description="disk the saved slot states may take (default "
        "{default}; least recently used dropped first)")
    gpu_memory_budget: Annotated[str | None, Flag("SIZE")] = Field(
        None, description="memory the children may use on each GPU (nvidia-smi): 'auto' (the "
        "GPU's memory less 1 GiB), 'off', a size, or INDEX=SIZE,... per GPU")
    max_queue: Annotated[int, Flag("N")] = Field(
        DEFAULT_MAX_QUEUE, gt=0,
        description="requests that may wait for models at once; more get 429 (default "
        "{default})")
    fairness: Annotated[float, Flag("S")] = Field(
        DEFAULT_FAIRNESS_S, gt=0,
        description="a swap waiting this long drains the busy model in its way (default "
        "{default})")
    crash_loop_limit: int = Field(DEFAULT_CRASH_LOOP_LIMIT, ge=1,
                                  description="consecutive failures after which a model is "
                                  "not restarted")
    liveness_interval: Annotated[float, Flag("S")] = Field(
        DEFAULT_LIVENESS_INTERVAL_S, ge=0,
        description="seconds between health checks of each serving child; 0: none (default "
        "{default})")
    liveness_timeout: Annotated[float, Flag("S")] = Field(
        DEFAULT_LIVENESS_TIMEOUT_S, gt=0,
        description="seconds a health check may take (default {default})")
    liveness_misses: Annotated[int, Flag("N")] = Field(
        DEFAULT_LIVENESS_MISSES, ge=1,
        description="failed health checks in a row that kill a frozen child (default "
        "{default})")
    shutdown_grace: Annotated[float, Flag("S")] = Field(
        DEFAULT_SHUTDOWN_GRACE_S, gt=0,
        description="seconds in-flight requests get on SIGTERM before they end with a 503 "
        "(default {default})")
    cpu_sharing: Annotated[bool, Flag()] = Field(  # cpus.py, cpugate.py
        True, description="start every child with llama.cpp's own thread defaults, no CPU "
        "turns between models (docs/scheduling.md#cpu-sharing)")
    child_args: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="arguments for every child (serve's after --)")
    webui: Annotated[bool, Flag()] = Field(
        True, description="serve no web UI at / (default: llama.cpp's, as installed by "
        "install-llama-server)")
    webui_path: Annotated[Path | None, Flag("DIR")] = Field(
        None, description="serve the web UI built in DIR (with index.html) instead")
    node_name: Annotated[str, Flag("NAME")] = Field(
        "", description="this router's name among peers: /models' node field, metrics' node "
        "label (default: the host name)")
    peer: Annotated[list[str], NoDecode, Flag("URL")] = Field(
        default_factory=list, description="another llama-router (or llama.cpp router) to "
        "front, http://host:port: its models are served through this one; repeatable "
        "(docs/deployment.md)")
    peer_api_key_file: Annotated[Path | None, Flag("FILE")] = Field(
        None, description="file with the API key sent to peers as a bearer token")
    peer_dns: Annotated[list[str], NoDecode, Flag("NAME:PORT")] = Field(
        default_factory=list, description="resolve NAME's A/AAAA records periodically; each "
        "address is a peer (a Kubernetes headless Service); repeatable")
    peer_dns_interval: Annotated[float, Flag("S")] = Field(
        DEFAULT_PEER_DNS_INTERVAL_S, gt=0,
        description="seconds between resolutions of --peer-dns (default {default})")
    peer_prefix: Annotated[bool, Flag()] = Field(
        False, description="list peers' models as NODE/MODEL instead of their own ids")
    default_model: Annotated[str | None, Flag("NAME")] = Field(  # defaults.py
        None, description="send requests that name no model (llama-server's own clients: "
        "/completion, /tokenize, ...) to this model, an id or alias (default: the router's "
        "only model when it has exactly one; docs/api.md#the-default-model)")
    unknown_model_to_default: Annotated[bool, Flag()] = Field(
        False, description="also send requests naming a model nobody serves (gpt-3.5-turbo, "
        "...) to the default model, instead of a 404")
    cors_origins: Annotated[str, Flag("ORIGINS")] = Field(  # origins.py
        DEFAULT_CORS_ORIGINS, description="what pages of other origins may use, a comma "
        "list: * (default: any page, inference routes), localhost (pages of this machine, "
        "inference routes), origins such as https://app.example (every route, admin too), or "
        "none (docs/api.md#browsers-and-cors)")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        """Each ``--api-key`` and ``LLAMA_ROUTER_API_KEY`` is a comma list of keys.
        ``LLAMA_ROUTER_API_KEY=`` (empty, as in an env file) is unset; keys asked for that
        hold none (``--api-key ""``, " , ") become ``[""]``, which ``all_api_keys`` refuses."""
        if value == "":
            return []
        given = [value] if isinstance(value, str) else value
        if isinstance(given, list) and given and all(isinstance(v, str) for v in given):
            return [key.strip() for v in given for key in v.split(",") if key.strip()] or [""]
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

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:  # the flag's choices; the variable's too
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return value.lower()

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


def flag_spelling(name: str) -> str | None:
    """The flag that sets the setting ``name`` (``Flag``): ``--models-max``; a bool's turns
    its default over (``--no-webui``); None for a setting set by its environment variable
    only. The one reading of it: the command line is built from it, errors name it."""
    field = Settings.model_fields[name]
    if not any(isinstance(m, Flag) for m in field.metadata):
        return None
    spelling = name.replace("_", "-")
    return f"--no-{spelling}" if field.annotation is bool and field.default else f"--{spelling}"


def describe(error: ValidationError) -> str:
    """What was wrong with the settings, one line a setting, each named as it is given: its
    flag (``flag_spelling``), if it has one, and its environment variable
    (``--state-budget (LLAMA_ROUTER_STATE_BUDGET)``), with the validator's own message (never
    pydantic's layout or links)."""
    lines = []
    for problem in error.errors(include_url=False):
        where = problem["loc"][0] if problem["loc"] else ""
        message = str(problem["msg"]).removeprefix("Value error, ")
        if isinstance(where, str) and where:
            variable = f"{Settings.model_config['env_prefix']}{where.upper()}"
            flag = flag_spelling(where) if where in Settings.model_fields else None
            name = f"{flag} ({variable})" if flag else variable
            given = problem.get("input")
            if isinstance(given, (str, int, float)) and str(given) not in message:
                message = f"{message} (given {given!r})"
            lines.append(f"  {name}: {message}")
        else:
            lines.append(f"  {message}")
    return "\n".join(lines)
