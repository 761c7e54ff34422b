#!/bin/bash
set -e
cd /app
sqlite3 inventory.db < schema.sql
sqlite3 inventory.db < seed.sql
sqlite3 inventory.db <<'SQL'
CREATE VIEW low_stock AS
SELECT i.sku, i.name, COALESCE(SUM(b.quantity), 0) AS on_hand
FROM items AS i LEFT JOIN bins AS b ON b.sku = i.sku
GROUP BY i.sku, i.name, i.reorder_level
HAVING COALESCE(SUM(b.quantity), 0) < i.reorder_level
ORDER BY i.sku;
SQL
