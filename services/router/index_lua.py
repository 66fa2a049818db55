"""Server-side Lua for the Redis prefix index (see ``index.RedisPrefixIndex``).

Layout in Redis (``P`` is the key prefix, e.g. ``kvmesh:``):

- ``P blk:<hash>``: a bitmap per block; bit ``2*slot + tier`` is set when the
  worker in ``slot`` holds the block in that tier (0 = GPU, 1 = KVSTORE). A
  bitmap *is* the block's set of (worker, tier) pairs, in a form one MGET can
  fetch for thousands of blocks and Lua can test with one byte read.
- ``P wblk:<worker>:<tier>``: the block keys a worker holds in a tier, so its
  entries can be dropped without scanning the whole index.
- ``P slots``: worker id -> small integer slot (its bit pair in every bitmap).
  A slot is freed only after every bit of it was cleared, so it never points
  at another worker's leftovers.

Block keys hold the 16 raw hash bytes, not hex: hex keys are 60% longer and
made the 12,500-block walk 40% slower (key hashing and Lua string creation
dominate it).

A chain's keys travel as ONE argument, the keys concatenated (``ARGV`` stride
= key length), and scripts cut it up rather than declaring keys in KEYS:
packing 12,500 separate arguments costs more in Python than the whole walk
costs in Redis. That is fine on a single Redis (and its replicas), not on
Redis Cluster.
"""

# Shared prologue of the write scripts: ARGV[1..4] = prefix, worker id, tier
# name, tier bit; ADD and REMOVE then take the concatenated block keys and the
# key length. Looks up the worker's slot and names its set for the tier.
_SLOT = """
local p, w, tier, tb = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local slots = p .. 'slots'
local slot = redis.call('HGET', slots, w)
local set = p .. 'wblk:' .. w .. ':' .. tier
"""

ADD = (
    _SLOT
    + """
if not slot then
  local used = {}
  for _, s in ipairs(redis.call('HVALS', slots)) do used[tonumber(s)] = true end
  slot = 0
  while used[slot] do slot = slot + 1 end
  redis.call('HSET', slots, w, slot)
end
local off = tonumber(slot) * 2 + tb
local keys, klen = ARGV[5], tonumber(ARGV[6])
local batch = {}
for i = 1, #keys, klen do
  local k = string.sub(keys, i, i + klen - 1)
  redis.call('SETBIT', k, off, 1)
  batch[#batch + 1] = k
  if #batch == 1000 then redis.call('SADD', set, unpack(batch)); batch = {} end
end
if #batch > 0 then redis.call('SADD', set, unpack(batch)) end
return 0
"""
)

# Clears one bit and deletes the bitmap once nobody holds the block.
_CLEAR_BIT = """
local function clear_bit(k)
  redis.call('SETBIT', k, off, 0)
  if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
end
"""

REMOVE = (
    _SLOT
    + """
if not slot then return 0 end
local off = tonumber(slot) * 2 + tb
"""
    + _CLEAR_BIT
    + """
local keys, klen = ARGV[5], tonumber(ARGV[6])
local batch = {}
for i = 1, #keys, klen do
  local k = string.sub(keys, i, i + klen - 1)
  clear_bit(k)
  batch[#batch + 1] = k
  if #batch == 1000 then redis.call('SREM', set, unpack(batch)); batch = {} end
end
if #batch > 0 then redis.call('SREM', set, unpack(batch)) end
return 0
"""
)

# Pops up to ARGV[5] of the worker's blocks in one tier and clears their bits;
# returns how many are left, so the client loops in bounded steps instead of
# blocking Redis for one long script. ARGV[6..] are all of the worker's tier
# sets: once every one is empty the slot is freed.
CLEAR_BATCH = (
    _SLOT
    + """
if not slot then redis.call('DEL', set); return 0 end
local off = tonumber(slot) * 2 + tb
"""
    + _CLEAR_BIT
    + """
for _, k in ipairs(redis.call('SPOP', set, tonumber(ARGV[5]))) do clear_bit(k) end
local left = redis.call('SCARD', set)
if left == 0 and redis.call('EXISTS', unpack(ARGV, 6)) == 0 then redis.call('HDEL', slots, w) end
return left
"""
)

# Walks the chain in growing MGET batches and stops as soon as no worker's GPU
# prefix and no kvstore prefix can grow. Consecutive blocks of one chain are
# usually held by the same workers, so their bitmaps are byte-equal; Lua
# interns strings, so `v ~= prev` is a pointer compare and most blocks cost
# nothing beyond the MGET. Returns {kvstore_blocks, worker, gpu_blocks, ...}
# with only the workers that hold at least the first block.
LONGEST_PREFIX = """
local p, chain, klen = ARGV[1], ARGV[2], tonumber(ARGV[3])
local n = #chain / klen
local sub = string.sub
local slots = redis.call('HGETALL', p .. 'slots')
local live = {}
for i = 1, #slots, 2 do
  local off = tonumber(slots[i + 1]) * 2
  live[#live + 1] = {slots[i], math.floor(off / 8) + 1, bit.rshift(128, off % 8)}
end
local gpu = {}
local kv_open, kv = true, 0
local prev = {}
local pos, size, stop = 0, 32, false
while pos < n and not stop do
  local hi = math.min(n, pos + size)
  local keys, j = {}, 0
  for i = pos * klen + 1, hi * klen, klen do
    j = j + 1
    keys[j] = sub(chain, i, i + klen - 1)
  end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #vals do
    local v = vals[j]
    if v ~= prev then
      prev = v
      if not v then v = '' end
      local before = pos + j - 1
      local keep = {}
      for _, c in ipairs(live) do
        local b = string.byte(v, c[2])
        if b and bit.band(b, c[3]) ~= 0 then keep[#keep + 1] = c else gpu[c[1]] = before end
      end
      live = keep
      if kv_open then
        local held = false
        for k = 1, #v do
          if bit.band(string.byte(v, k), 0x55) ~= 0 then held = true; break end
        end
        if not held then kv_open, kv = false, before end
      end
      if #live == 0 and not kv_open then stop = true; break end
    end
  end
  if not stop then pos = hi end
  size = math.min(size * 4, 4096)  -- unpack() is limited to ~8000 values
end
for _, c in ipairs(live) do gpu[c[1]] = pos end
if kv_open then kv = pos end
local out = {kv}
for w, c in pairs(gpu) do
  if c > 0 then out[#out + 1] = w; out[#out + 1] = c end
end
return out
"""
