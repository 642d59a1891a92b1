"""What llama.cpp defines, as the router reads it: the llama-server binary and its build from
llama.cpp's source (``install``), the flags that binary takes (``flags``, learned from its own
``--help``), the GGUF header (``ggufmeta``), llama-server's unstreamed answer made from its
stream (``unstreamed``), llama.cpp's web UI (``webui``), and the models of the demo and the
tests (``tinymodel``, ``smollm2``).

It owns nothing that runs: it reads and builds llama.cpp's artefacts. It may import
``foundation`` only, so that every other part can read llama.cpp's formats.
"""
