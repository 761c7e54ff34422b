CREATE TABLE items (
    sku TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    reorder_level INTEGER NOT NULL
);

CREATE TABLE bins (
    bin TEXT NOT NULL,
    sku TEXT NOT NULL REFERENCES items (sku),
    quantity INTEGER NOT NULL,
    PRIMARY KEY (bin, sku)
);
