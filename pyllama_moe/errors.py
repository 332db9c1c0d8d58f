"""One exception type for bad input: the CLI prints its message alone and exits non-zero."""


class UserError(Exception):
    """A problem the user can fix. The message names the thing and the fix, in one line."""

    def __init__(self, what: str, fix: str | None = None):
        self.what = what
        self.fix = fix
        super().__init__(f"{what}: {fix}" if fix else what)
