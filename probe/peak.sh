# ferry at a ballasted cap: speed and the GPU memory its process really held (nvidia-smi, every 100 ms)
M=$1; CAP=$2; shift 2
python3 - "$CAP" <<'PY' &
import sys, torch, time
free, _ = torch.cuda.mem_get_info(); held = torch.empty(max(free - int(float(sys.argv[1]) * 2**30), 0), dtype=torch.uint8, device="cuda")
print("ballast: free", torch.cuda.mem_get_info()[0] / 2**30, flush=True); time.sleep(100000)
PY
BP=$!; sleep 15
for FT in "$@"; do
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 100 > /tmp/smi.txt & SP=$!
  python3 -m ferry bench -m $M -t 16 -r 3 -p 512 -n 128 $FT 2> /tmp/err.txt | tail -2
  kill $SP; grep -E "fit|auto" /tmp/err.txt | cut -c1-400
  echo "flags '$FT': peak MiB per pid:"; sort -t, -k1,1 -k2,2n /tmp/smi.txt | awk -F, '{m[$1]=$2>m[$1]?$2:m[$1]} END {for (p in m) print p, m[p]}'
done
kill $BP
