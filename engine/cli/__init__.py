"""The ``dpfl`` command line: ``dpfl run``, ``dpfl compare``, ``dpfl tune``, ``dpfl
report``, ``dpfl privacy``, ``dpfl algorithms``, ``dpfl config`` and ``dpfl submit``
(any of them as a Ray job on a cluster).

Contract with users:

* Invalid input (a bad value, an unknown key, a YAML syntax error, a missing file, a
  bad flag) exits with status 2 and one line on stderr, ``dpfl: error: ...``, naming
  the value; checks run before any folder is created or Ray is started.
* Results are never overwritten: an existing results folder is an error naming
  ``--resume`` (where a command can continue) and ``--overwrite`` (which removes the
  old folder first, stale reports and figures included). Default folder names carry
  the time to the microsecond and are created exclusively, so two commands started
  together never share one.
* Ray's console chatter (its log lines, the C++ core worker's warnings, workers'
  output) goes to ``ray.log`` in the results folder; ``--verbose`` shows it instead.

One module per command: :mod:`.run`, :mod:`.privacy`, :mod:`.compare`, :mod:`.tune`
(``tune`` and ``report``), :mod:`.info` (``algorithms`` and ``config``), :mod:`.submit`;
:mod:`.dispatch` holds :func:`main`, the one-line errors and :func:`console_main`
(the executable's entry, which skips the interpreter's teardown once the command is
done), :mod:`.parser` the flags, :mod:`.common` what the commands share (results
folders, ``ray.log``).
"""

from __future__ import annotations

from engine.cli.dispatch import console_main, main

__all__ = ["console_main", "main"]
