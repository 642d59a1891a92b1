"""What the operator declares: process settings from flags and environment (``settings``),
API key files (``keyfile``), CORS origins (``origins``), listen addresses (``listen``), INI
presets in llama.cpp's format (``presets``), a name's request policy (``policy``: the body
fields a preset sets, replaces or removes), the environment variables a preset may give its
children (``envvars``), a request's keep_alive read as a duration (``durations``), where
models come from (``sources``, merged into one catalogue), Hugging Face downloads
(``downloads``), and what a new catalogue changes (``reconfig``).

It owns the configuration as frozen values; nothing here runs a model. It may import
``foundation``, ``llama`` and ``host``.
"""
