"""Platform-contract case run on each framework's workers (no pytest there): the abstract members
of ``Platform`` the live platform's class leaves unimplemented (none expected)."""


def unimplemented_abstract_members(rank, world_size):
    import inspect

    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.base import Platform
    cls = type(get_platform())   # instantiating it already fails on a missing abstract member
    missing = []
    for name in sorted(Platform.__abstractmethods__):
        member = inspect.getattr_static(cls, name)
        if getattr(member, "__isabstractmethod__", False) or \
                getattr(getattr(member, "fget", None), "__isabstractmethod__", False):
            missing.append(name)
    return {"platform": cls.__name__, "missing": missing}
