class _Missing:
    """An sgl_kernel op the stand-in does not provide: importable, raises when called."""

    def __init__(self, name):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.__name__}: not in the CPU stand-in of sgl_kernel "
                                  "(examples/sglang_e2e/cpu_setup/sgl_kernel)")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


def missing(name):
    return _Missing(name)
