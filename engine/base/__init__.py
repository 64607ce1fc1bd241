"""Foundations every room may use, importing nothing else of dpfl.

:mod:`.errors` holds :class:`~engine.base.errors.ConfigError`, the one error a bad
configuration value raises (its message names the key), and :mod:`.atomic` the one
atomic-write helper through which every file dpfl writes goes (a temporary file, then
``os.replace``; a crash leaves the old file or the new one, never a torn one).
"""
