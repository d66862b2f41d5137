"""nam-plugin-grouped-moe: the ``grouped`` routed experts (``nam_plugin_grouped_moe.experts``)."""
