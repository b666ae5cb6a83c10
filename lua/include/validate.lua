-- Shared helpers: argument validation, time and number formatting.
-- Validation raises an error reply before any write, so a bad argument changes nothing.

-- Hooks main.lua runs after a successful main() (the bucket cache registers its write-back).
local AT_EXIT = {}

local function fail(code, msg)
  error({err = code .. ' ' .. msg})
end

-- The error for a value arg_num or arg_int refused: which check it failed.
local function fail_number(v, field, lo, hi)
  local n = tonumber(v)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then
    fail('BADARG', field .. ': not a number: ' .. tostring(v))
  end
  if n < lo or n > hi then
    fail('BADARG', field .. ': ' .. tostring(v) .. ' is outside [' .. tostring(lo) .. ', ' .. tostring(hi) .. ']')
  end
  fail('BADARG', field .. ': not an integer: ' .. tostring(v))
end

-- A number in [lo, hi] (finite bounds, both required). One test on the common path, the checks
-- that name the problem only for a refused value: argument checks were a fifth of a
-- push_tokens call (callgrind), run on every argument of every call. (NaN fails the
-- comparisons; with finite bounds, so does an infinity.)
local function arg_num(v, field, lo, hi)
  local n = tonumber(v)
  if n ~= nil and n >= lo and n <= hi then return n end
  fail_number(v, field, lo, hi)
end

-- An integer in [lo, hi] (finite bounds, both required), as arg_num.
local function arg_int(v, field, lo, hi)
  local n = tonumber(v)
  -- (n % 1, not n == math.floor(n): no function call, ~220 of a check's ~1.5k instructions)
  if n ~= nil and n >= lo and n <= hi and n % 1 == 0 then return n end
  fail_number(v, field, lo, hi)
end

-- Names become parts of keys: no braces, colons, spaces or globs.
-- A string of 1 to 64 characters matching `pattern`; else BADARG naming `field` and `what`.
local function arg_matching(v, field, pattern, what)
  if type(v) ~= 'string' or #v < 1 or #v > 64 or not string.match(v, pattern) then
    fail('BADARG', field .. ': invalid ' .. what .. ': ' .. tostring(v))
  end
  return v
end

local function arg_name(v, field)
  return arg_matching(v, field, '^[%w_%.%-]+$', 'name')
end

-- A class name is also part of hash fields: <class>.cost, <class>.<state> and <class>:<tenant>,
-- next to <class> itself and the served ledger's .ts. Without dots, no class's field can be
-- another class's (classes 'a' and 'a.cost' shared the field a.cost) or the ledger's.
local function arg_class_name(v, field)
  return arg_matching(v, field, '^[%w_%-]+$', 'class name (letters, digits, _ and -)')
end

local function arg_oneof(v, field, allowed)
  for _, a in ipairs(allowed) do
    if v == a then return v end
  end
  fail('BADARG', field .. ': must be one of ' .. table.concat(allowed, '|') .. ', got ' .. tostring(v))
end

-- The requests in a call of `item` arguments each (scripts that take several calls' requests
-- in one call: admit, complete), at most `max_items`. A call of one request may leave out
-- its optional last arguments: their own checks name what is missing.
local function arg_items(item, max_items)
  local n = math.max(math.floor(#ARGV / item), 1)
  if #ARGV > item and #ARGV ~= n * item then
    fail('BADARG', 'ARGV: ' .. #ARGV .. ' arguments are not groups of ' .. item .. ' (one per request)')
  end
  if n > max_items then fail('BADARG', 'ARGV: ' .. n .. ' requests, at most ' .. max_items .. ' a call') end
  return n
end

-- Milliseconds since the epoch from the Redis server clock (never the client's).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Full precision: Lua's tostring keeps only 14 digits, which would lose fractional tokens.
local function fmt(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then
    return string.format('%d', x)
  end
  local short = string.format('%.15g', x)
  if tonumber(short) == x then return short end
  return string.format('%.17g', x)
end
