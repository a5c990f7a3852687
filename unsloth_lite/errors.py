"""The error types for bad user input (a recipe, an override, a data file or record, a model path). Each message
is one line naming the key, file or record and what was expected; the CLI prints it and exits with code 2."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()) if "\n" in str(message) else str(message))


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none): for wrapping a library's error
    into an `InputError`."""
    return " ".join(str(error).split()) or type(error).__name__


class RecipeError(InputError):
    """A recipe that cannot be used; the message names the offending key (dotted) or the file."""


class DataError(InputError):
    """A data file or record that cannot be used; the message names the file, the line or record, the field."""
