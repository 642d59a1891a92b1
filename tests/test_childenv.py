"""What a child's environment keeps and loses (``router.children.childenv``); the same with a real
llama-server child is in ``test_childenv_real.py``."""

from __future__ import annotations

from router.children.childenv import child_environment, ignored

ROUTER_ENV = {
    # kept: the machine's settings a child relies on
    "PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "1",
    "HIP_VISIBLE_DEVICES": "0", "GGML_CUDA_NO_PINNED": "1", "OMP_NUM_THREADS": "4",
    "MTMD_BACKEND_DEVICE": "CUDA0", "HF_ENDPOINT": "http://mirror", "LLAMA_CACHE": "/c",
    "LLAMA_ROUTER_PORT": "8080", "XAIP_MODE": "x", "LLAMA_ARGS": "not an option",
    # removed: secrets
    "LLAMA_API_KEY": "k1", "LLAMA_ARG_API_KEY": "k2", "LLAMA_ROUTER_API_KEY": "k3",
    "LLAMA_ROUTER_API_KEY_FILE": "/k", "HF_TOKEN": "t", "LLAMA_ARG_SSL_KEY_FILE": "/s",
    # removed: another deployment, inherited options, the router's own child-mode settings
    "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "8080", "AIP_HEALTH_ROUTE": "/h",
    "AIP_PREDICT_ROUTE": "/p", "LLAMA_ARG_PORT": "9", "LLAMA_ARG_HOST": "0.0.0.0",
    "LLAMA_ARG_CTX_SIZE": "256", "LLAMA_ARG_NO_MMAP": "1", "LLAMA_ARG_EMBEDDINGS": "1",
    "LLAMA_SERVER_ROUTER_PORT": "1", "LLAMA_SERVER_CHILD_MODE": "download",
}
KEPT = {"PATH", "HOME", "LANG", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
        "GGML_CUDA_NO_PINNED", "OMP_NUM_THREADS", "MTMD_BACKEND_DEVICE", "HF_ENDPOINT",
        "LLAMA_CACHE", "LLAMA_ROUTER_PORT", "XAIP_MODE", "LLAMA_ARGS"}


def test_a_child_keeps_the_machines_settings_and_loses_the_rest() -> None:
    env = child_environment(ROUTER_ENV)
    assert set(env) == KEPT
    assert all(env[name] == ROUTER_ENV[name] for name in KEPT)


def test_what_a_user_may_have_meant_for_children_is_named_secrets_are_not() -> None:
    assert ignored(ROUTER_ENV) == sorted(
        ["AIP_MODE", "AIP_HTTP_PORT", "AIP_HEALTH_ROUTE", "AIP_PREDICT_ROUTE", "LLAMA_ARG_PORT",
         "LLAMA_ARG_HOST", "LLAMA_ARG_CTX_SIZE", "LLAMA_ARG_NO_MMAP", "LLAMA_ARG_EMBEDDINGS",
         "LLAMA_SERVER_ROUTER_PORT", "LLAMA_SERVER_CHILD_MODE"])
    assert ignored({"PATH": "/usr/bin", "HF_TOKEN": "t"}) == []
