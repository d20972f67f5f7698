"""CPU of a round trip on psycopg 3, client and server, and of pipelining one away.

Not part of ``python -m benchmarks`` (it prints no target); the figures behind
``docs/performance.md`` (*CPU per call of an IdempotentTask*, what is left). On a private
PostgreSQL, in blocks of ``--n`` calls alternated ``--rounds`` times, per call: the client's
CPU (``time.process_time``) and the server backend's (its ``/proc`` entry, 10 ms ticks):

* ``select1``: one prepared ``SELECT 1`` in autocommit (one round trip);
* ``tx``: ``BEGIN``, an insert, an update returning a row, ``COMMIT`` (four round trips:
  the shape of an ``IdempotentTask`` body's transaction with its fenced completion);
* ``tx_piped``: the same with the update and the ``COMMIT`` sent in one psycopg pipeline
  (three network round trips).

    PYTHONPATH=. python benchmarks/profile_roundtrip.py --n 4000 --rounds 3
"""
import argparse
import os
import sys
import time
from pathlib import Path


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import psycopg

    from harness.servers import PostgresServer

    with PostgresServer() as pg:
        conn = psycopg.connect(pg.url.replace("postgresql+psycopg", "postgresql"))
        cur = conn.cursor()
        cur.execute("CREATE TABLE rt (id serial PRIMARY KEY, n int)")
        cur.execute("INSERT INTO rt (n) VALUES (0)")
        conn.commit()
        pid = conn.info.backend_pid

        def select1() -> None:
            cur.execute("SELECT 1", prepare=True)
            cur.fetchone()

        def tx() -> None:
            cur.execute("INSERT INTO rt (n) VALUES (%s)", (1,), prepare=True)
            cur.execute("UPDATE rt SET n = n + 1 WHERE id = %s RETURNING id", (1,),
                        prepare=True)
            cur.fetchone()
            conn.commit()

        def tx_piped() -> None:
            cur.execute("INSERT INTO rt (n) VALUES (%s)", (1,), prepare=True)
            with conn.pipeline():
                cur.execute("UPDATE rt SET n = n + 1 WHERE id = %s RETURNING id", (1,),
                            prepare=True)
                conn.commit()
            cur.fetchone()

        shapes = {"select1": select1, "tx": tx, "tx_piped": tx_piped}
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in shapes}
        for r in range(args.rounds):
            order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
            for name in order:
                conn.autocommit = name == "select1"
                f = shapes[name]
                for _ in range(50):
                    f()
                b0, c0 = backend_cpu(pid), time.process_time()
                for _ in range(args.n):
                    f()
                c1, b1 = time.process_time(), backend_cpu(pid)
                res[name].append(((c1 - c0) / args.n * 1e6, (b1 - b0) / args.n * 1e6))
        print("per call, each round: client CPU µs / server backend CPU µs")
        for name, v in res.items():
            print(f"{name:9s}", "  ".join(f"{c:4.0f} / {b:4.0f}" for c, b in v))
        conn.close()


if __name__ == "__main__":
    main()
