"""What a run tells: metrics.jsonl, TensorBoard events, the console and progress, trackers' kinds,
summaries, the writers' threads, profiles and FLOP counts; the libraries' chatter kept off the console."""
