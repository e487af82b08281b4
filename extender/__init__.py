"""The scheduler extender: filter nodes by architecture, score them by network traffic.

Each module imports only from the lines below its own (and from the core), so each can be read
and tested without those above it:

  routes        the two routes, declared once (archway.server.routes), their metrics and log
                lines
  service       Extender: filter and prioritize on parsed arguments, no HTTP; score_signals,
                the one place prioritize's signals are registered
  trafficscore  the traffic signal: scores of the sample per node, corrected by herd control
  pollerprocess the traffic poller in a process of its own, kept running by `archway serve`
  prometheus    the one query of a refresh, its answer, the poller shared by the workers
  ceiling       extender.max_utilisation: filter turns away nodes whose link is too busy
  signals       the seam: what a score signal gives, how several combine, the answer
  traffic       what a node's traffic and link capacity are worth as a score (pure)
  archfilter    which candidates may run the pod, by architecture (pure)
  herd          the pods placed since the last sample, and the pod watch that confirms them
  wire          the extender's JSON: ExtenderArgs parsed, the replies built
  schedconfig   `archway scheduler-config`: the second scheduler's configuration

A new score signal: a module shaped like signals.ScoreSignal, and one line in
service.score_signals.
"""
