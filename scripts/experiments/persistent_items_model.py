"""A model of the persistent sm90 forward's item protocol (kernels/sm90/attention_fwd.cuh: ForEachWork, PrefetchWork,
Consume), to check a change of it before it meets the GPU: one producer thread, C consumer warpgroups,
two q buffers (q full / q empty barriers as phase counts, waits by parity), a ring of S stages, a work counter, reruns
asked through the q buffer's word. Random interleavings; checks termination, that every work runs once and its careful
pass runs exactly when a consumer asked, that parity waits are never two phases behind, and that both sides agree on
ring positions. Usage: python scripts/experiments/persistent_items_model.py [SEEDS] (prints the failing runs and their
count)."""
import random, sys

CAREFUL, ASKED, INDEX = 1 << 30, 1 << 29, (1 << 29) - 1

def run(seed, works, grid, consumers=2, stages=2):
  rng = random.Random(seed)
  cta = 0  # model one CTA of the grid; the counter is shared, the other CTAs take from it at random moments
  tiles = {w: rng.choice([0, 1, 2, 3]) for w in range(works)}
  nan = {w: (tiles[w] > 0 and rng.random() < 0.3, rng.randrange(consumers)) for w in range(works)}  # straddles+NaN, which wg
  S = dict(counter=0, item=[cta, 0], qfull=[1, 0], qempty=[0, 0], qempty_arrivals=[0, 0],
           produced=0, released=[0] * consumers, done=[], careful_done=[], asked=set())
  errors = []

  def wait_parity(kind, b, phase):  # waiting for the completion of phase `phase` (0-based) of barrier b
    def ready():
      count = S[kind][b]
      if count >= phase + 2: errors.append(f"{kind}[{b}] waited for phase {phase} with {count} completed")
      return count >= phase + 1
    return ready

  def take():
    v = S["counter"]; S["counter"] += 1
    return v + grid

  def producer():
    ring, nxt, n = 0, -1, 0
    while True:
      item = S["item"][n % 2]
      if (item & INDEX) >= works: return
      careful = bool(item & CAREFUL)
      if nxt < 0: nxt = take(); yield None
      count = tiles[item & INDEX] * (2 if careful else 1)
      for i in range(ring, ring + count):
        yield lambda i=i: min(S["released"]) >= i - stages + 1  # stage free: every consumer released position i - S
        S["produced"] = i + 1
      ring += count
      # PrefetchWork(n + 1)
      m = n + 1; b = m % 2; item_new = nxt
      took = False
      if m >= 2:
        yield wait_parity("qempty", b, (m - 2) // 2)
        word = S["item"][b]
        if word & ASKED:
          S["item"][b] = word & ~ASKED; item_new = (word & INDEX) | CAREFUL; took = True
      if not took and nxt >= works:
        at = (m - 1) % 2
        yield wait_parity("qempty", at, (m - 1) // 2)
        word = S["item"][at]
        if word & ASKED:
          S["item"][at] = word & ~ASKED; item_new = (word & INDEX) | CAREFUL
      if item_new == nxt: nxt = -1
      S["item"][b] = item_new
      yield None
      S["qfull"][b] += 1  # q landed (or the bare arrival past the last work)
      n += 1

  def consumer(c):
    ring, n = 0, 0
    while True:
      b = n % 2
      if n > 0: yield wait_parity("qfull", b, n // 2)
      item = S["item"][b]
      idx = item & INDEX
      if idx >= works: return
      careful = bool(item & CAREFUL)
      if n == 0: pass
      else: yield None
      count = tiles[idx] * (2 if careful else 1)
      for i in range(ring, ring + count):
        yield lambda i=i: S["produced"] >= i + 1
        S["released"][c] = i + 1
        yield None
      ring += count
      if c == 0: (S["careful_done"] if careful else S["done"]).append(idx)
      straddles_nan, wg = nan[idx]
      if not careful and straddles_nan and wg == c:
        S["item"][b] |= ASKED; S["asked"].add(idx)
      yield None
      S["qempty_arrivals"][b] += 1
      if S["qempty_arrivals"][b] == consumers:
        S["qempty_arrivals"][b] = 0; S["qempty"][b] += 1
      n += 1

  actors = [producer()] + [consumer(c) for c in range(consumers)]
  waits = [None] * len(actors)
  alive = set(range(len(actors)))
  steps = 0
  while alive:
    ready = [a for a in alive if waits[a] is None or waits[a]()]
    # other CTAs take from the counter now and then
    if rng.random() < 0.05: S["counter"] += 1
    if not ready:
      return f"deadlock: waits {[a for a in alive]}; state {S}"
    a = rng.choice(ready)
    try:
      waits[a] = next(actors[a])
    except StopIteration:
      alive.discard(a)
    steps += 1
    if steps > 100000: return "no end"
  if errors: return errors[0]
  mine = sorted(S["done"])
  if len(set(mine)) != len(mine): return f"a work ran twice: {mine}"
  if sorted(S["careful_done"]) != sorted(S["asked"]): return f"careful {sorted(S['careful_done'])} vs asked {sorted(S['asked'])}"
  return None

bad = 0
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20000):
  r = random.Random(seed)
  works = r.randint(1, 12); grid = r.randint(1, works)
  err = run(seed, works, grid)
  if err:
    bad += 1
    if bad <= 5: print("seed", seed, "works", works, "grid", grid, ":", err)
print("bad runs:", bad)
