-- msgpack encoding of a flat map (string keys; string, integer, boolean values), used for
-- the latency samples scripts write. Real Redis ships cmsgpack; embedded servers used for
-- single-machine demos (fakeredis) do not, so this small encoder stands in for it there.

local function mp_uint(n, bytes)
  local out = {}
  for i = bytes, 1, -1 do
    out[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(out)
end

local function mp_value(v)
  local t = type(v)
  if t == 'boolean' then return v and '\195' or '\194' end
  if t == 'number' and v == math.floor(v) and math.abs(v) < 2^53 then
    if v >= 0 then
      if v < 128 then return string.char(v) end
      if v < 2^8 then return '\204' .. mp_uint(v, 1) end
      if v < 2^16 then return '\205' .. mp_uint(v, 2) end
      if v < 2^32 then return '\206' .. mp_uint(v, 4) end
      return '\207' .. mp_uint(v, 8)
    end
    if v >= -32 then return string.char(256 + v) end
    if v >= -2^31 then return '\210' .. mp_uint(2^32 + v, 4) end  -- int32, two's complement
    -- int64 in two 32-bit halves: 2^64 + v itself is not exact in a double
    local hi = math.floor(v / 2^32)
    return '\211' .. mp_uint(2^32 + hi, 4) .. mp_uint(v - hi * 2^32, 4)
  end
  local s = tostring(v)
  if #s < 32 then return string.char(160 + #s) .. s end
  if #s < 2^8 then return '\217' .. mp_uint(#s, 1) .. s end
  if #s < 2^16 then return '\218' .. mp_uint(#s, 2) .. s end
  return '\219' .. mp_uint(#s, 4) .. s
end

local function msgpack_map(t)
  if cmsgpack then return cmsgpack.pack(t) end
  local parts, n = {}, 0
  for k, v in pairs(t) do
    parts[#parts + 1] = mp_value(k) .. mp_value(v)
    n = n + 1
  end
  local head = n < 16 and string.char(128 + n) or ('\222' .. mp_uint(n, 2))
  return head .. table.concat(parts)
end
