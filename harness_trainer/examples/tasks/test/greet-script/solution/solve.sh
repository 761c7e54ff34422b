#!/bin/bash
# Reference solution (absolute paths: works from any cwd).
set -euo pipefail
cat > /app/greet.sh <<'EOF'
#!/bin/bash
echo "Hello, ${1:-world}!"
EOF
chmod +x /app/greet.sh
