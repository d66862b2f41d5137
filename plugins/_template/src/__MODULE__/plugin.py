"""Entry point of the __NAME__ plugin: what it declares and the hooks it implements.

Keep this module light: heavy imports (kernels, GPU libraries) go inside hook bodies, so that
`nam plugins list` can read PLUGIN without importing them.
"""

from nam_core import PluginInfo, Requirement, hookimpl

PLUGIN = PluginInfo(
    summary="__NAME__: say in one line what it offers.",
    provides={"indexer": ["__NAME__"]},
    requires=(),  # e.g. Requirement.cuda_capability(at_least=(9, 0)), Requirement.package("triton>=3.4")
)


@hookimpl
def nam_register_indexer_backends(register):
    register("__NAME__", object)  # replace `object` with the implementing class
