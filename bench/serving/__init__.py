"""`switchyard bench`: the limit, Switchyard end to end and its peers on one workload; the load generator."""
