-- Runs main() and turns a raised {err = 'CODE message'} into a plain error reply. Every
-- validation happens before the first write, so an error reply means no change. The AT_EXIT
-- hooks (e.g. the bucket cache written back) run after main() either way: a runtime error
-- after some writes would be a bug, and Redis keeps the writes made before it -- the
-- buckets' must be kept too, or a record would say "refunded" for a credit never written.
--!include validate.lua

local ok, res = pcall(main)
for _, hook in ipairs(AT_EXIT) do
  if ok then hook() else pcall(hook) end  -- the reply is main()'s error, not a hook's
end
if ok then return res end
local m = type(res) == 'table' and res.err or tostring(res)
return redis.error_reply(string.match(m, '(%u%u+ .*)$') or m)
