"""dpfl's benchmarks: scripts run as modules from the repository root
(``python -m benchmarks.<name>``) and the library they share (workloads, the plain
reference loop, process and machine measurement). Every figure a benchmark prints is
measured in that run, with the machine's load beside it."""
