import os
import sqlite3


def connect():
    return sqlite3.connect(os.environ["INVENTORY_DB"])


def test_seed_data_loaded():
    with connect() as db:
        assert db.execute("SELECT count(*) FROM items").fetchone() == (6,)
        assert db.execute("SELECT sum(quantity) FROM bins").fetchone() == (782,)


def test_low_stock_view():
    with connect() as db:
        kind = db.execute("SELECT type FROM sqlite_master WHERE name = 'low_stock'").fetchone()
        assert kind == ("view",)
        rows = db.execute("SELECT sku, name, on_hand FROM low_stock").fetchall()
    assert rows == [
        ("A-200", "hex nut M6", 60),
        ("B-310", "cable tie 200mm", 480),
        ("C-002", "shelf board", 7),
        ("D-900", "label roll", 0),
    ]
