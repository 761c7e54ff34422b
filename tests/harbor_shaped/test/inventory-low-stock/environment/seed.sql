INSERT INTO items (sku, name, reorder_level) VALUES
    ('A-100', 'hex bolt M6', 200),
    ('A-200', 'hex nut M6', 150),
    ('B-310', 'cable tie 200mm', 500),
    ('C-001', 'shelf bracket', 20),
    ('C-002', 'shelf board', 10),
    ('D-900', 'label roll', 5);

INSERT INTO bins (bin, sku, quantity) VALUES
    ('R1-01', 'A-100', 120),
    ('R1-02', 'A-100', 90),
    ('R1-03', 'A-200', 60),
    ('R2-01', 'B-310', 480),
    ('R2-02', 'C-001', 25),
    ('R3-01', 'C-002', 4),
    ('R3-02', 'C-002', 3);
