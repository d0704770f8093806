"""What observes the job: the event log, the recoveries' timelines, Prometheus metrics, the status page.

- ``events``: the event log's versioned records, its bounded appender and its readers
- ``timeline``: recoveries grouped from the event log, their phases and timelines (no I/O)
- ``metrics``: Prometheus metrics, the controller's and each node agent's
- ``status_page``: the live status page served with the metrics
- ``threadcpu``: the CPU of chosen threads (the replication's share of the overhead budget)
- ``procfs``: what /proc says of a watched process (the warm process's memory)
- ``units``: sizes for people (what the agents and the replicas print about bytes held)
"""
