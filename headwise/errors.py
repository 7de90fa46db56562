"""The error a request's bad parameter raises, naming the parameter (the server's 400 names it too)."""
from __future__ import annotations


class InvalidParameterError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
