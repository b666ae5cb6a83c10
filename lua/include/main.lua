-- Runs main() and turns a raised {err = 'CODE message'} into a plain error reply. Every
-- validation happens before the first write, so an error reply means no change. After a
-- successful main() the AT_EXIT hooks run (e.g. the bucket cache is written back).
--!include validate.lua

local ok, res = pcall(main)
if ok then
  for _, hook in ipairs(AT_EXIT) do hook() end
  return res
end
local m = type(res) == 'table' and res.err or tostring(res)
return redis.error_reply(string.match(m, '(%u%u+ .*)$') or m)
