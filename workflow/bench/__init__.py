"""The benchmark's statistics, the machine probe, the bandwidth floor, the rows replay, the profilers."""
