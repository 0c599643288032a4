"""The JitTrainer and what it uses: rank agreement, the signal latch, the stop record, the runtime grace check."""
