"""A clock the test moves by hand: cache ages, back-offs and leases without sleeping."""


class ManualClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
