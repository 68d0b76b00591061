"""The two exceptions of the public contract."""


class ContractError(ValueError):
    """An invalid call: names the argument, the expected and the actual value.

    Raised by `deltarule.linear_attention` before any work starts; a call that
    raises it has read nothing out of bounds and modified nothing.
    """

    def __init__(self, argument: str, expected: str, actual: object):
        self.argument = argument
        self.expected = expected
        self.actual = actual
        super().__init__(f"{argument}: expected {expected}, got {actual}")


class Unsupported(RuntimeError):
    """deltarule declines a valid request; the message says why.

    A backend declining a call (`backend="auto"` catches it and moves on to the
    next backend), or an integration declining the installed library
    (`deltarule.integrations.transformers.enable()` on an unsupported transformers).
    """


def positive_log_decay(name: str, x, flat_index: int) -> ContractError:
    """The error of a positive log decay in `name` (g or gk, a tensor) at flat index
    `flat_index`: g and gk are natural logs of the decay factor, so never positive."""
    where = []
    for size in reversed(x.shape):
        flat_index, i = divmod(flat_index, size)
        where.append(i)
    where = where[::-1]
    return ContractError(name, "log-space decays <= 0 (natural log of the decay factor, e.g. log(0.9), "
                         "not 0.9; -inf resets the state)", f"{name}{where} = {x[tuple(where)].item():g}")


def one_line(error: BaseException, most: int | None = None) -> str:
    """`error`'s message on one line (a validator's or a runtime's span several), cut to `most`
    characters where given: what the command line prints and what the export quotes."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text if most is None or len(text) <= most else text[:most - 3] + "..."
