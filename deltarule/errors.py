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
