"""The SGLang client: version-aware HTTP API, engine config, server launch and start-up checks, server pool."""
