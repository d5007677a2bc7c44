"""`switchyard bench --workload NAME`: one feature at a time, through real servers."""
